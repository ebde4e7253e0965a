"""aiodist-run for jobs that must keep running: restarting only failed workers, graceful stops.

Every test starts the real launcher as a process with real worker processes
(``tests/launcher_worker.py``) and checks what they printed and how they ended.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import clean_env
from proc_helpers import track

from aiodist.errors import DistUsageError
from aiodist.launcher import parse_args
from aiodist.testing import free_port

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
WORKER = str(HERE / "launcher_worker.py")
RUN = [sys.executable, "-m", "aiodist.run"]


def launch(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*RUN, *args], capture_output=True, text=True, timeout=timeout, env=clean_env()
    )


def start(*args: str) -> subprocess.Popen[str]:
    return track(
        subprocess.Popen(
            [*RUN, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=clean_env(),
        )
    )


def wait_ready(proc: subprocess.Popen[str], n: int) -> list[str]:
    """Read the launcher's stdout until ``n`` workers printed "ready"; return what was read."""
    assert proc.stdout is not None
    lines = []
    while sum(line.endswith(": ready") for line in lines) < n:
        line = proc.stdout.readline()
        assert line, "the launcher's stdout closed before every worker was ready"
        lines.append(line.rstrip("\n"))
    return lines


def by_rank(out: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\[rank(\d+)\]: (.*)", line)
        assert m, f"unprefixed output line {line!r}"
        lines.setdefault(int(m[1]), []).append(m[2])
    return lines


# -- the command line -------------------------------------------------------------------------
def test_restart_policy_and_shutdown_grace_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_args(["s.py"])
    assert (cfg.restart_policy, cfg.shutdown_timeout) == ("all", 30.0)
    cfg = parse_args(["--restart-policy=failed", "--shutdown-grace=2.5", "s.py"])
    assert (cfg.restart_policy, cfg.shutdown_timeout) == ("failed", 2.5)
    # torchrun's name for the grace period, and the underscored spellings.
    cfg = parse_args(["--restart_policy", "failed", "--shutdown_timeout=4", "s.py"])
    assert (cfg.restart_policy, cfg.shutdown_timeout) == ("failed", 4.0)
    monkeypatch.setenv("PET_RESTART_POLICY", "failed")
    assert parse_args(["s.py"]).restart_policy == "failed"
    monkeypatch.setenv("PET_RESTART_POLICY", "some")
    with pytest.raises(DistUsageError, match=r"--restart-policy='some' is not valid: expected all"):
        parse_args(["s.py"])
    with pytest.raises(DistUsageError, match=r"--shutdown-grace=-1.0 must not be negative"):
        parse_args(["--restart-policy=all", "--shutdown-grace=-1", "s.py"])


def test_unknown_restart_policy_exits_2() -> None:
    result = launch("--restart-policy=some", WORKER, "env")
    assert result.returncode == 2
    assert "argument --restart-policy/--restart_policy: invalid choice: 'some'" in result.stderr


# -- restarting only the failed worker ---------------------------------------------------------
def test_failed_rank_is_restarted_alone_and_the_group_is_rebuilt() -> None:
    """Rank 2 crashes after a first all_reduce; only it is restarted. Ranks 0 and 1 (the same
    processes) see their next all_reduce raise, destroy and init their group again, and the
    three run an all_reduce in the new group: 1 + 2 + (3 + 10 for the restarted rank)."""
    result = launch(
        "--nproc-per-node=3", "--restart-policy=failed", "--max-restarts=1", WORKER, "rebuild", "2"
    )
    assert result.returncode == 0, result.stderr
    lines = by_rank(result.stdout)
    pids: dict[int, set[str]] = {}
    for rank in range(3):
        pids[rank] = {m[1] for line in lines[rank] if (m := re.search(r" pid=(\d+)$", line))}
        assert [line.rsplit(" pid=", 1)[0] for line in lines[rank] if "sum=" in line] == [
            "first sum=6",
            f"rebuilt restart={int(rank == 2)} sum=16",
        ]
    assert (len(pids[0]), len(pids[1]), len(pids[2])) == (1, 1, 2)
    for rank in (0, 1):
        (noticed,) = [line for line in lines[rank] if line.startswith("noticed")]
        # Which survivor hears first, and how (the lost connection, the peer's abort, the
        # store), varies; every path names rank 2 and raises DistNetworkError.
        assert noticed.startswith("noticed DistNetworkError: ")
        assert "rank 2" in noticed
    assert re.search(
        r"rank 2 \(pid \d+\) exited with exit code 3; restarting it alone \(its restart 1 of 1\), "
        r"the other workers keep running",
        result.stderr,
    )
    assert "the job failed" not in result.stderr


@pytest.mark.parametrize("when", ["before", "during", "connected"])
def test_a_worker_lost_before_the_group_formed_is_replaced_in_the_forming_group(
    when: str,
) -> None:
    """Rank 1 dies before the job's group formed (before its init_process_group; inside
    it, once it counted in the world being formed; or once connected to the others, before
    its leases, as they set the group up). Its replacement calls join_process_group, finds
    no running world to join and takes rank 1 in the one being formed. Killed inside
    init_process_group, rank 1 already took part in that world: the others'
    init_process_group fails (the generation "can never be complete", or the world broke
    during the set-up), they are restarted alone too, and the group forms with the
    replacements."""
    result = launch(
        "--nproc-per-node=3", "--restart-policy=failed", "--max-restarts=1", WORKER, "early",
        "1", when,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = by_rank(result.stdout)
    restarts = [0, 1, 0] if when == "before" else [1, 1, 1]
    total = 6 + 10 * sum(restarts)
    for rank in range(3):
        assert lines[rank] == [f"restart={restarts[rank]} sum={total} size=3 state=[0.0, 0.0]"]
    assert "rank 1 (pid " in result.stderr and "exited with signal SIGKILL" in result.stderr


def test_restarted_rank_keeps_its_identity_and_store() -> None:
    result = launch(
        "--nproc-per-node=3", "--restart-policy=failed", "--max-restarts=2", "--rdzv-id=keep",
        WORKER, "env-crash", "1",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    envs = {r: json.loads(lines[-1]) for r, lines in by_rank(result.stdout).items()}
    assert sorted(envs) == [0, 1, 2]
    for rank, env in envs.items():
        count = "1" if rank == 1 else "0"
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"]) == (str(rank), str(rank), "3")
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", envs[0]["MASTER_PORT"])
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["AIODIST_RESTART_COUNT"] == count
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "2"
        assert env["AIODIST_RESTART_POLICY"] == "failed"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"keep/attempt_{count}/{rank}/error.json")


def test_failed_rank_out_of_restarts_stops_the_job() -> None:
    result = launch(
        "--nproc-per-node=3", "--restart-policy=failed", "--max-restarts=2", "--shutdown-grace=5",
        WORKER, "fail", "1", "7",
    )  # fmt: skip
    assert result.returncode == 1
    # The others were started once and never restarted; rank 1 ran three times.
    assert by_rank(result.stdout) == {0: ["waiting"], 2: ["waiting"]}
    assert result.stderr.count("[rank1]: failing on purpose") == 3
    assert "restarting it alone (its restart 1 of 2)" in result.stderr
    assert "restarting it alone (its restart 2 of 2)" in result.stderr
    summary = result.stderr[result.stderr.index("aiodist-run: the job failed") :]
    assert re.search(
        r"root cause: rank 1 \(local rank 1 on node 0, pid \d+\) failed first", summary
    )
    assert "with exit code 7" in summary
    assert (
        "rank 1 had been restarted 2 times (--max-restarts=2, --restart-policy=failed); "
        "the other workers were stopped"
    ) in summary


def test_failed_rank_restarts_across_nodes() -> None:
    """Two launchers (2 workers each): rank 3 on node 1 crashes and is restarted alone; the
    world of 4 is rebuilt across both nodes, and node 0 never restarts anything."""
    port = str(free_port())
    common = [
        "--nnodes=2", f"--master-port={port}", "--nproc-per-node=2", "--restart-policy=failed",
        "--max-restarts=1",
    ]  # fmt: skip
    nodes = [
        track(
            subprocess.Popen(
                [*RUN, *common, f"--node-rank={n}", WORKER, "rebuild", "3"],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=clean_env(),
            )
        )
        for n in (0, 1)
    ]
    (out0, err0), (out1, err1) = (n.communicate(timeout=60) for n in nodes)
    assert [n.returncode for n in nodes] == [0, 0], err0 + err1
    rebuilt = {r: lines[-1].rsplit(" pid=", 1)[0] for r, lines in by_rank(out0 + out1).items()}
    # 1 + 2 + 3 + (4 + 10 for the restarted rank)
    assert rebuilt == {r: f"rebuilt restart={int(r == 3)} sum=20" for r in range(4)}
    assert "restarting it alone" not in err0
    assert "rank 3 (pid" in err1 and "restarting it alone (its restart 1 of 1)" in err1


# -- stopping gracefully -----------------------------------------------------------------------
def test_sigterm_lets_workers_finish_their_step() -> None:
    proc = start(
        "--nproc-per-node=3", "--shutdown-grace=30", "--restart-policy=failed",
        "--max-restarts=3", WORKER, "graceful", "0.3", "finish,finish143,finish",
    )  # fmt: skip
    before = wait_ready(proc, 3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    lines = by_rank("\n".join(before) + "\n" + out)
    for rank in range(3):
        code = 143 if rank == 1 else 0
        assert re.fullmatch(
            rf"SIGTERM x1 during step \d+: finished it, exit {code}", lines[rank][-1]
        )
        assert re.search(
            rf"rank {rank} \(pid \d+\) stopped \d+\.\d\d s after SIGTERM, with exit code {code}",
            err,
        )
    assert "received SIGTERM: stopping the workers (30 s grace period)" in err
    # Exits after a forwarded SIGTERM are neither failures nor restarted.
    assert "the job failed" not in err and "root cause" not in err
    assert "restarting" not in err and "SIGKILL" not in err


def test_worker_ignoring_sigterm_is_killed_after_the_grace() -> None:
    proc = start(
        "--nproc-per-node=2", "--shutdown-grace=1.5", WORKER, "graceful", "0.2", "finish,ignore"
    )
    wait_ready(proc, 2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    elapsed = time.monotonic() - t0
    assert proc.returncode == 128 + signal.SIGTERM
    assert elapsed >= 1.5  # the ignoring worker had its whole grace period
    assert re.fullmatch(r"SIGTERM x1 during step \d+: finished it, exit 0", by_rank(out)[0][-1])
    assert re.search(r"rank 0 \(pid \d+\) stopped \d+\.\d\d s after SIGTERM, with exit code 0", err)
    assert "workers still running 1.5 s after SIGTERM: sending SIGKILL to rank 1" in err
    assert re.search(
        r"rank 1 \(pid \d+\) did not exit within the 1.5 s grace period after SIGTERM: "
        r"killed with SIGKILL",
        err,
    )
    assert "the job failed" not in err


def test_second_signal_kills_at_once() -> None:
    proc = start("--nproc-per-node=2", "--shutdown-grace=60", WORKER, "ignore-term")
    wait_ready(proc, 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.stderr is not None
    while "received SIGTERM" not in proc.stderr.readline():
        pass
    proc.send_signal(signal.SIGINT)
    _out, err = proc.communicate(timeout=30)  # far less than the 60 s grace period
    assert proc.returncode == 128 + signal.SIGTERM
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank} \(pid \d+\) was still running when the launcher received a second "
            r"signal \(SIGINT\): killed with SIGKILL",
            err,
        )


def test_signalled_node_is_the_root_cause_on_the_other_node() -> None:
    """Node 0 is stopped while the workers run all_reduces across both nodes; its rank 0 leaves
    at once, its rank 1 after 2 s. Node 1's workers lose their peers and fail, but node 1
    names node 0's signal as the root cause (told before node 0's workers left), not its
    own ranks."""
    port = str(free_port())
    common = ["--nnodes=2", f"--master-port={port}", "--nproc-per-node=2", "--shutdown-grace=10"]
    n0 = start(*common, WORKER, "serve", "0,2,0,0")
    n1 = start(*common, "--node-rank=1", WORKER, "serve", "0,2,0,0")
    wait_ready(n0, 2)
    wait_ready(n1, 2)
    n0.send_signal(signal.SIGTERM)
    out0, err0 = n0.communicate(timeout=60)
    _out1, err1 = n1.communicate(timeout=60)
    assert (n0.returncode, n1.returncode) == (128 + signal.SIGTERM, 1), err0 + err1
    assert "root cause: the launcher of node 0 was stopped by signal SIGTERM (15)" in err1
    assert by_rank(out0) == {r: ["stopped after SIGTERM"] for r in (0, 1)}
    for rank in (0, 1):
        assert re.search(
            rf"rank {rank} \(pid \d+\) stopped \d+\.\d\d s after SIGTERM, with exit code 0", err0
        )
    assert "the job failed" not in err0
