"""The flag group every part of the configuration adds its flags to."""


class Group:
    """An argument group that skips flags already defined, so the user's custom arguments (added first) and
    Megatron's own flags win over slime's definitions of the same name."""

    def __init__(self, parser, title):
        self._parser = parser
        self._group = parser.add_argument_group(title)

    def add_argument(self, *flags, **kwargs):
        if any(f in self._parser._option_string_actions for f in flags):
            return None
        return self._group.add_argument(*flags, **kwargs)


def reset_arg(parser, name, **kwargs):
    """Change the default of an existing (Megatron) option, or add it (slime's defaults for Megatron flags)."""
    for action in parser._actions:
        if name in action.option_strings:
            if "default" in kwargs:
                action.default = kwargs["default"]
                parser.set_defaults(**{action.dest: kwargs["default"]})
            return action
    return parser.add_argument(name, **kwargs)
