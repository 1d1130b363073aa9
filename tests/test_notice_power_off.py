"""A node that has left on a spot notice shuts itself down (``node.power_off_after_notice``, which
fleetd's launch template turns on): the instance stops billing when its step is durable, not at
AWS's interruption time. Only after the notice flow has returned, only for a terminate notice,
and never where the setting is off (an agent run by hand or by a test)."""

from __future__ import annotations

import asyncio
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from agent.config import AgentConfig, NodeConfig
from agent.main import Agent
from fleetd.adapters.launch_template import agent_user_data, parse_user_data_env
from fleetd.config import FleetdConfig
from fleetd.protocol.messages import Notice


class FlowHooks:
    def __init__(self, marker: Path, fail: bool = False) -> None:
        self.marker, self.fail = marker, fail
        self.flow_done_before_power_off: bool | None = None

    async def on_notice(self, notice: Notice) -> None:
        await asyncio.sleep(0)
        if self.fail:
            raise RuntimeError("the upload failed")
        self.flow_done_before_power_off = not self.marker.exists()


def _agent(tmp_path: Path, on: bool) -> tuple[Agent, Path]:
    marker = tmp_path / "powered-off"
    command = (sys.executable, "-c", f"open({str(marker)!r}, 'w').write('off')")
    cfg = AgentConfig(node=NodeConfig(state_dir=tmp_path, power_off_after_notice=on, shutdown_command=command))
    return Agent(cfg), marker


def _notice(action: str = "terminate") -> Notice:
    return Notice(instance_id="i-1", action=action, action_time=datetime.now(UTC) + timedelta(seconds=120))


@pytest.mark.parametrize(
    ("on", "action", "fail", "powered_off"),
    [
        (True, "terminate", False, True),
        (False, "terminate", False, False),  # the default: a hand-run agent never powers off
        (True, "stop", False, False),  # a stop notice: the instance comes back, do not terminate it
        (True, "terminate", True, False),  # the flow failed: AWS reclaims it at its time
    ],
)
async def test_power_off_follows_the_notice_flow(tmp_path: Path, on: bool, action: str, fail: bool, powered_off: bool):
    agent, marker = _agent(tmp_path, on)
    hooks = FlowHooks(marker, fail)
    if fail:
        with pytest.raises(RuntimeError):
            await agent._notice_then_power_off(hooks, _notice(action))  # type: ignore[arg-type]
    else:
        await agent._notice_then_power_off(hooks, _notice(action))  # type: ignore[arg-type]
    assert marker.exists() is powered_off
    if powered_off:
        assert hooks.flow_done_before_power_off is True


def test_fleetds_launch_template_turns_it_on() -> None:
    env = parse_user_data_env(agent_user_data(FleetdConfig()))
    assert env["FLEETD_NODE__POWER_OFF_AFTER_NOTICE"] == "true"
    assert AgentConfig(
        node=NodeConfig(power_off_after_notice=env["FLEETD_NODE__POWER_OFF_AFTER_NOTICE"])
    ).node.power_off_after_notice
    assert NodeConfig().power_off_after_notice is False


async def test_a_hook_still_running_at_shutdown_does_not_keep_the_agent_alive(tmp_path: Path) -> None:
    """A hook task waiting on a trainer that is gone (a checkpoint acknowledgement that never
    comes) is cancelled with the components at the end of the bounded shutdown."""
    agent, _ = _agent(tmp_path, on=False)
    never = asyncio.Event()

    async def waits_for_ever() -> None:
        await never.wait()

    async def component() -> None:
        await asyncio.Event().wait()

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        agent._tg = tg
        components = [tg.create_task(component())]
        agent._spawn("hooks.on_checkpoint", waits_for_ever)
        await asyncio.sleep(0)
        assert len(agent._spawned) == 1
        agent._cancel_all(components)
    assert not agent._spawned  # done and forgotten


def test_a_task_that_will_not_end_after_the_shutdown_exits_the_process_and_says_where(tmp_path: Path) -> None:
    """The last bound: past the grace after the cancel, the process logs each stuck task's stack
    and exits (a node whose agent never exits never powers off)."""
    import subprocess

    code = (
        "import asyncio\n"
        "from agent.node.last_bound import exit_unless_done\n"
        "async def deaf():\n"
        "    while True:\n"
        "        try:\n"
        "            await asyncio.sleep(3600)\n"
        "        except asyncio.CancelledError:\n"
        "            pass  # swallowed: the bug this bound is for\n"
        "async def main():\n"
        "    t = asyncio.create_task(deaf(), name='deaf-hook')\n"
        "    await asyncio.sleep(0)\n"
        "    t.cancel()\n"
        "    exit_unless_done(0.3, [t])\n"
        "    await t\n"
        "asyncio.run(main())\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1, res.stderr[-2000:]
    out = res.stdout + res.stderr
    assert "agent_shutdown_stuck" in out and "deaf-hook" in out and "deaf" in out
