from slime.config.parser import main

main()
