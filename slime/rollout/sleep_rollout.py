"""A rollout function that never returns: keeps the trainers idle (debugging, or holding a job's resources)."""

import time


def sleep(args, rollout_id, data_source, evaluation=False):
    count = 0
    while True:
        time.sleep(3600)
        count += 1
        print(f"rollout {rollout_id}: sleeping for {count} hour(s)")
