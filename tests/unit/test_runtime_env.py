"""read_launch_env: torchrun's variables parsed, stale or malformed ones named with a fix."""

from __future__ import annotations

import pytest

from meshrun.errors import EnvError
from meshrun.runtime.env import read_launch_env


def test_no_launcher_env_is_a_world_of_one():
    env = read_launch_env({})
    assert (env.rank, env.world_size, env.launched) == (0, 1, False)


def test_torchrun_env_is_read():
    env = read_launch_env({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
                           "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"})
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert (env.master_addr, env.master_port, env.launched) == ("10.0.0.1", 29500, True)


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc'"),
        ({"RANK": "x", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "1"}, "RANK='x'"),
        ({"RANK": "0"}, "WORLD_SIZE is not"),
        ({"WORLD_SIZE": "2"}, "RANK is not"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 must be < WORLD_SIZE=2"),
        ({"RANK": "0", "WORLD_SIZE": "0"}, "WORLD_SIZE=0"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "", "MASTER_PORT": "1"}, "MASTER_ADDR"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is unset"),
        ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "99999"}, "MASTER_PORT=99999"),
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "-1"}, "LOCAL_RANK=-1"),
    ],
)
def test_bad_env_names_the_variable_in_one_line(environ, named):
    with pytest.raises(EnvError) as info:
        read_launch_env(environ)
    message = str(info.value)
    assert named in message and "\n" not in message
