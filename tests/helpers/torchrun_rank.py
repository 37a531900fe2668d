"""``parallel-models-ppo``'s ``main`` for a test of a rank other than 0 under torchrun: when the
rank starts waiting to be stopped (``train.leave_after_rank0``) it first creates the file named
by ``PM_TEST_WAIT_MARKER``, so the test knows the rank got there and did not leave."""

from __future__ import annotations

import os


def main(argv=None):
    from parallel_models.rl import train

    wait = train.leave_after_rank0

    def marked_wait(*args, **kwargs):
        open(os.environ["PM_TEST_WAIT_MARKER"], "w").close()
        return wait(*args, **kwargs)

    train.leave_after_rank0 = marked_wait
    return train.main(argv)
