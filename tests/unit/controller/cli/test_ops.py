"""`borrowd stop/resume/status/gate`: what they change in Redis and what they print."""

from __future__ import annotations

import argparse
import json
import time

import pytest
from borrowd.adapters.gate import Gate
from borrowd.adapters.pool_registry import PoolRegistry
from borrowd.adapters.redis_conn import connect
from borrowd.adapters.store import BudgetStore, LeaderElection
from borrowd.controller.cli import main, ops
from borrowd.models.budget import Budget, Mode
from borrowd.models.errors import BorrowdError, ConfigError, InputError

from tests.support.servers import free_port

POOL = "p1"


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="borrowd")
    ops.register(parser.add_subparsers())
    args = parser.parse_args(argv)
    return args.func(args)


def _publish(url: str) -> None:
    client = connect(url)
    PoolRegistry(client).register([POOL], "daemon-a", time.time())
    BudgetStore(client, POOL).publish(
        Budget(pool=POOL, mode=Mode.OPEN, reason="law", batch_tokens_per_s=100.0,
               batch_burst_tokens=1000, max_batch_seqs=4, max_batch_kv_tokens=1000,
               max_batch_output_tokens=100),
        epoch=3, ttl_ms=60_000, now_s=time.time())
    Gate(client, POOL).admit("r1", 10, 20)
    client.close()


def test_stop_status_resume(redis_url, capsys) -> None:
    """stop revokes and switches to stopped; status shows it; resume clears the switch."""
    _publish(redis_url)
    assert _run(["stop", "--pool", POOL, "--reason", "incident 7", "--redis", redis_url]) == 0
    assert "stopped (epoch 3, seq 2): incident 7" in capsys.readouterr().out
    assert _run(["status", "--pool", POOL, "--redis", redis_url, "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["record"]["mode"] == "stopped"
    assert status["stop_switch"] == "incident 7"
    assert status["usable"] is False
    assert status["inflight"]["batch_seqs"] == 0
    assert status["revocations_kept"] == 1
    assert _run(["resume", "--pool", POOL, "--redis", redis_url]) == 0
    assert "resumed" in capsys.readouterr().out
    assert BudgetStore(connect(redis_url), POOL).stop_reason() is None


def test_status_text_shows_record_and_inflight(redis_url, capsys) -> None:
    """The text status names mode, epoch, seq, age, stop switch and batch work in flight."""
    _publish(redis_url)
    assert _run(["status", "--pool", POOL, "--redis", redis_url]) == 0
    out = capsys.readouterr().out
    assert "mode=open epoch=3 seq=1" in out
    assert "age=" in out
    assert "stop switch   off" in out
    assert "1 batch seqs, 30 KV tokens reserved" in out


def test_unreachable_redis_is_one_line_error() -> None:
    """A dead Redis becomes a BorrowdError naming the URL (the CLI prints one line, exit 2)."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    with pytest.raises(BorrowdError, match=f"Redis at {url}"):
        _run(["status", "--pool", POOL, "--redis", url])


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--listen", "nowhere"], "--listen"),
        (["--listen", "127.0.0.1:8089", "--lease-ms", "0"], "--lease-ms"),
        (["--listen", "127.0.0.1:8089", "--pool", "a{b}"], "pool name"),
    ],
    ids=["bad-listen", "zero-lease", "bad-pool"],
)
def test_gate_refuses_bad_arguments(extra, message) -> None:
    """`gate` names a bad --listen, --lease-ms or pool before it starts serving."""
    with pytest.raises(InputError, match=message):
        _run(["gate", "--pool", POOL, *extra])


def _gate_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="borrowd")
    ops.register(parser.add_subparsers())
    return parser.parse_args(["gate", *argv])


def test_gate_settings_come_from_the_file_with_flags_on_top(tmp_path) -> None:
    """`gate --config FILE`: the [gate] table through the one loader, flags winning."""
    path = tmp_path / "gate.toml"
    path.write_text('[gate]\npools = ["chat", "code"]\nlease_ms = 5000\n'
                    '[[gate.callers]]\nname = "nginx"\nsecret = "0123456789abcdef"\n')
    config = ops.gate_settings(_gate_args(["--config", str(path), "--lease-ms", "7000"]))
    assert (config.pools, config.lease_ms) == (("chat", "code"), 7000)
    assert [caller.name for caller in config.callers] == ["nginx"]
    path.write_text('[gate]\npools = ["chat"]\ndecision_timeout_s = nan\n')
    with pytest.raises(ConfigError, match=f"gate config {path}: gate.decision_timeout_s"):
        ops.gate_settings(_gate_args(["--config", str(path)]))
    with pytest.raises(InputError, match="--pool is required"):
        ops.gate_settings(_gate_args([]))


def test_borrowd_main_prints_one_line_and_exits_2(capsys) -> None:
    """Through `borrowd` itself, a dead Redis is one stderr line and exit code 2."""
    url = f"redis://127.0.0.1:{free_port()}/0"
    assert main(["stop", "--pool", POOL, "--reason", "x", "--redis", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith(f"borrowd: error: Redis at {url}")


@pytest.mark.parametrize("command", [["stop", "--reason", "typo"], ["resume"], ["status"]],
                         ids=["stop", "resume", "status"])
def test_unknown_pool_is_refused_naming_the_known_ones(redis_url, capsys, command) -> None:
    """A pool no daemon registered is refused (exit 2, the known pools named), and nothing
    is written for it."""
    _publish(redis_url)
    PoolRegistry(connect(redis_url)).register(["embed"], "daemon-b", time.time())
    LeaderElection(connect(redis_url), "led", "daemon-c", 1000).try_acquire()
    assert main([command[0], "--pool", "chat-8b", *command[1:], "--redis", redis_url]) == 2
    err = capsys.readouterr().err
    assert err == ("borrowd: error: pool 'chat-8b' is not known: no daemon has registered or "
                   f"led it (known pools: embed, led, {POOL}); --force acts on it anyway\n")
    assert connect(redis_url).keys("borrowd:{chat-8b}:*") == []


def test_force_acts_on_an_unregistered_pool(redis_url, capsys) -> None:
    """--force stops a pool no daemon registered (e.g. before its daemon first starts)."""
    assert _run(["stop", "--pool", "new", "--reason", "pre-launch", "--force",
                 "--redis", redis_url]) == 0
    assert "pool new: stopped" in capsys.readouterr().out
    assert BudgetStore(connect(redis_url), "new").stop_reason() == "pre-launch"


def test_pool_with_a_leader_history_counts_as_known(redis_url, capsys) -> None:
    """A pool whose epoch counter exists (a leader was elected) is known without registry."""
    client = connect(redis_url)
    client.set("borrowd:{old}:epoch", 4)
    assert _run(["status", "--pool", "old", "--redis", redis_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["epoch_counter"] == 4


def test_registry_round_trip(redis_url) -> None:
    """register() records holder and time per pool; known() reads them back."""
    registry = PoolRegistry(connect(redis_url))
    registry.register(["a", "b"], "ctl-1", 1000.0)
    registry.register(["b"], "ctl-2", 2000.0)
    known = registry.known()
    assert sorted(known) == ["a", "b"]
    assert (known["b"].holder_id, known["b"].registered_at_s) == ("ctl-2", 2000.0)
    assert registry.exists("a") and not registry.exists("c")


def test_daemon_registers_its_pools_at_start(redis_url) -> None:
    """Building the daemon registers every configured pool under its holder id, so `stop`
    knows them before any leader was elected; with Redis down it starts all the same."""
    from borrowd.controller.cli.daemon import build_daemon
    from borrowd.controller.config import config_from_mapping

    config = config_from_mapping({"daemon": {"holder_id": "ctl-1"},
                                  "pools": [{"name": "chat"}, {"name": "embed"}]})
    build_daemon(config, redis_client=connect(redis_url))
    known = PoolRegistry(connect(redis_url)).known()
    assert {name: known[name].holder_id for name in known} == {"chat": "ctl-1",
                                                              "embed": "ctl-1"}
    build_daemon(config, redis_client=connect(f"redis://127.0.0.1:{free_port()}/0"))
