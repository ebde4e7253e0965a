"""aiodist-run on one node: flags, worker environment, output, failures, signals, restarts.

Every test starts the real launcher as a process with real worker processes
(``tests/launcher_worker.py``) and checks what they printed and how they ended.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from cluster_helpers import clean_env

from aiodist.errors import DistUsageError
from aiodist.launcher import get_args_parser, parse_args
from aiodist.launcher._workers import Std
from aiodist.testing import free_port

pytestmark = pytest.mark.multiprocess

HERE = Path(__file__).parent
WORKER = str(HERE / "launcher_worker.py")


def launch(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aiodist.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or clean_env(),
    )


def start(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "aiodist.run", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env or clean_env(),
    )


def by_rank(out: str) -> dict[int, list[str]]:
    lines: dict[int, list[str]] = {}
    for line in out.splitlines():
        m = re.fullmatch(r"\[rank(\d+)\]: (.*)", line)
        assert m, f"unprefixed output line {line!r}"
        lines.setdefault(int(m[1]), []).append(m[2])
    return lines


def wait_ready(proc: subprocess.Popen[str], n: int) -> list[str]:
    assert proc.stdout is not None
    seen = []
    while len(seen) < n:
        line = proc.stdout.readline()
        assert line, "the launcher's stdout closed before every worker was ready"
        if line.rstrip().endswith(": ready"):
            seen.append(line)
    return seen


# -- the command line -------------------------------------------------------------------------
def test_defaults_are_torchruns() -> None:
    ns = get_args_parser().parse_args(["script.py"])
    assert (ns.nnodes, ns.nproc_per_node, ns.node_rank) == ("1:1", "1", 0)
    assert (ns.master_addr, ns.master_port, ns.rdzv_endpoint, ns.rdzv_id) == (
        "127.0.0.1",
        None,
        "",
        "none",
    )
    assert (ns.max_restarts, ns.monitor_interval, ns.standalone) == (0, 0.1, False)
    assert (ns.module, ns.no_python, ns.log_dir, ns.redirects, ns.tee) == (
        False,
        False,
        None,
        "0",
        "0",
    )
    assert ns.local_ranks_filter == ""
    assert ns.signals_to_handle == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    cfg = parse_args(["script.py", "--lr", "0.1"])
    assert cfg.cmd == (sys.executable, "-u", "script.py", "--lr", "0.1")
    assert cfg.master_port == 0  # one node and no port: a free one, as torchrun does


@pytest.mark.parametrize(
    "flag",
    [
        "--nproc-per-node=3",
        "--nproc_per_node=3",
        "--node-rank=1",
        "--node_rank=1",
        "--master-addr=10.1.2.3",
        "--master_addr=10.1.2.3",
        "--master-port=1234",
        "--master_port=1234",
        "--max-restarts=2",
        "--max_restarts=2",
        "--monitor-interval=0.5",
        "--monitor_interval=0.5",
        "--log-dir=/tmp/x",
        "--log_dir=/tmp/x",
        "--local-ranks-filter=0",
        "--local_ranks_filter=0",
        "--rdzv-endpoint=h:5",
        "--rdzv_endpoint=h:5",
    ],
)
def test_dashed_and_underscored_spellings(flag: str) -> None:
    ns = get_args_parser().parse_args(["--nnodes=2", flag, "s.py"])
    dest, value = flag[2:].replace("-", "_").split("=")
    assert str(getattr(ns, dest)) == value


def test_pet_environment_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PET_NPROC_PER_NODE", "3")
    monkeypatch.setenv("PET_MAX_RESTARTS", "2")
    monkeypatch.setenv("PET_STANDALONE", "1")
    monkeypatch.setenv("PET_TEE", "3")
    cfg = parse_args(["s.py"])
    assert (cfg.nproc_per_node, cfg.max_restarts, cfg.tees) == (3, 2, (Std.ALL,) * 3)
    assert cfg.master_addr == "127.0.0.1" and cfg.master_port == 0
    # The command line wins over the environment.
    assert parse_args(["--nproc-per-node=2", "s.py"]).nproc_per_node == 2


def test_endpoint_flags() -> None:
    cfg = parse_args(["--rdzv-endpoint=node0:4000", "--nnodes=2", "s.py"])
    assert (cfg.master_addr, cfg.master_port) == ("node0", 4000)
    assert parse_args(["--rdzv-endpoint=node0", "--nnodes=2", "s.py"]).master_port == 29400
    assert parse_args(["--rdzv-endpoint=[::1]:7", "s.py"]).master_addr == "::1"
    cfg = parse_args(["--nnodes=2", "--master-addr=10.0.0.1", "s.py"])
    assert (cfg.master_addr, cfg.master_port) == ("10.0.0.1", 29500)
    cfg = parse_args(["--nnodes=2:2", "--node-rank=1", "--master-port=7", "s.py"])
    assert (cfg.nnodes, cfg.node_rank, cfg.master_port) == (2, 1, 7)


def test_output_and_signal_flags() -> None:
    cfg = parse_args(["--nproc-per-node=3", "-r", "0:1,2:3", "-t", "2", "s.py"])
    assert cfg.redirects == (Std.OUT, Std.NONE, Std.ALL)
    assert cfg.tees == (Std.ERR,) * 3
    cfg = parse_args(["--nproc-per-node=3", "--local-ranks-filter=0,2", "s.py"])
    assert cfg.local_ranks_filter == {0, 2}
    cfg = parse_args(["--signals-to-handle=SIGUSR1,TERM", "s.py"])
    assert cfg.signals == (signal.SIGUSR1, signal.SIGTERM)
    assert parse_args(["-m", "pkg.mod", "a"]).cmd == (sys.executable, "-u", "-m", "pkg.mod", "a")
    assert parse_args(["--no-python", "./run.sh", "a"]).cmd == ("./run.sh", "a")
    # torchrun's --run-path runs the path with python, whatever else is asked.
    assert parse_args(["--run-path", "--no-python", "t.py"]).cmd == (sys.executable, "-u", "t.py")


def test_c10d_rendezvous_settings_are_ignored() -> None:
    conf = "last_call_timeout=3,is_host=1,store_type=tcp,join_timeout=7,read_timeout=60"
    cfg = parse_args([f"--rdzv-conf={conf}", "--rdzv-backend=c10d", "t.py"])
    assert cfg.join_timeout == 7.0
    assert cfg.last_call_timeout == 3.0  # (taken: it closes the rendezvous of MIN:MAX nodes)


def test_elastic_node_counts() -> None:
    cfg = parse_args(["--nnodes=2:4", "--node-rank=3", "t.py"])
    assert (cfg.nnodes, cfg.max_nnodes, cfg.elastic) == (2, 4, True)
    assert cfg.node_rank == 0  # (ranks follow arrival)
    assert cfg.master_port == 29500 and cfg.last_call_timeout == 30.0
    for fixed in ("3", "3:3"):
        cfg = parse_args([f"--nnodes={fixed}", "t.py"])
        assert (cfg.nnodes, cfg.max_nnodes, cfg.elastic) == (3, None, False)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes=4:1"], r"--nnodes='4:1' is not valid: expected N >= 1 or MIN:MAX with 1"),
        (["--nnodes=1:2:3"], r"--nnodes='1:2:3' is not valid"),
        (["--nnodes=x"], r"--nnodes='x' is not valid"),
        (["--nproc-per-node=0"], r"--nproc-per-node='0' is not valid: expected at least 1"),
        (["--nproc-per-node=gpux"], r"expected a positive integer, gpu, auto or cpu"),
        (["--nnodes=2", "--node-rank=2"], r"--node-rank=2 is not valid with --nnodes=2"),
        (["--standalone", "--nnodes=2"], r"--standalone runs one node, but --nnodes=2"),
        (["--nnodes=2", "--master-port=0"], r"several nodes need a fixed port"),
        (["--max-restarts=-1"], r"--max-restarts=-1 must not be negative"),
        (["--monitor-interval=0"], r"--monitor-interval=0.0 must be positive"),
        (["-m", "--no-python"], r"--module and --no-python cannot be used together"),
        (["-r", "5"], r"--redirects='5' is not valid"),
        (["--nproc-per-node=2", "-t", "3:1"], r"names local rank 3, but there are only 2"),
        (["--local-ranks-filter=a"], r"--local-ranks-filter='a' is not valid"),
        (["--nproc-per-node=2", "--local-ranks-filter=2"], r"names ranks outside 0..1"),
        (["--signals-to-handle=SIGNOPE"], r"unknown signal 'SIGNOPE'"),
        (["--signals-to-handle=SIGKILL"], r"SIGKILL cannot be caught"),
        (["--rdzv-conf=bogus=1"], r"--rdzv-conf item 'bogus=1' is not valid"),
        (["--rdzv-endpoint=h:x"], r"invalid port 'x'"),
    ],
)
def test_bad_flags_are_named(argv: list[str], message: str) -> None:
    with pytest.raises(DistUsageError, match=message):
        parse_args([*argv, "s.py"])


def test_bad_flag_exits_2_with_message() -> None:
    result = launch("--nproc-per-node=0", WORKER, "env")
    assert result.returncode == 2
    assert "aiodist-run: error: --nproc-per-node='0' is not valid" in result.stderr
    result = launch("--no-such-flag", WORKER)
    assert result.returncode == 2 and "unrecognized arguments" in result.stderr


# -- running workers -----------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sync-allreduce", "allreduce"])
def test_seed_scenario_all_reduce_on_every_rank(mode: str) -> None:
    result = launch("--nproc-per-node=4", WORKER, mode)
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {r: ["sum=10 expected=10"] for r in range(4)}


def test_console_script_runs_the_example() -> None:
    script = Path(sys.executable).with_name("aiodist-run")
    result = subprocess.run(
        [
            str(script),
            "--standalone",
            "--nproc-per-node=2",
            str(HERE.parent / "examples" / "data_parallel_sgd.py"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stderr
    lines = by_rank(result.stdout)
    for rank in range(2):
        assert "weights match the single-process numpy reference" in lines[rank][-1]


@pytest.mark.parametrize("module", ["aiodist.run", "aiodist.launcher"])
def test_python_m_runs_the_launcher(module: str, tmp_path: Path) -> None:
    script = tmp_path / "hello.py"
    script.write_text(
        'import os\nprint("rank", os.environ["RANK"], "of", os.environ["WORLD_SIZE"])\n'
    )
    result = subprocess.run(
        [sys.executable, "-m", module, "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=clean_env(),
    )
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {0: ["rank 0 of 2"], 1: ["rank 1 of 2"]}


def test_worker_environment() -> None:
    result = launch(
        "--nproc-per-node=2", "--rdzv-id=job7", "--role=trainer", "--max-restarts=3",
        WORKER, "env", "a", "--b",
        env=clean_env(OMP_NUM_THREADS="5"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    envs = {r: json.loads(lines[0]) for r, lines in by_rank(result.stdout).items()}
    port = envs[0]["MASTER_PORT"]
    assert int(port) > 0
    for rank, env in envs.items():
        assert env["argv"] == ["a", "--b"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"], env["ROLE_NAME"]) == (
            "0",
            "1",
            "trainer",
        )
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("127.0.0.1", port)
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True"
        assert env["TORCHELASTIC_RESTART_COUNT"] == env["AIODIST_RESTART_COUNT"] == "0"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "3"
        assert env["TORCHELASTIC_RUN_ID"] == env["AIODIST_RUN_ID"] == "job7"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(f"job7/attempt_0/{rank}/error.json")
        assert env["OMP_NUM_THREADS"] == "5"  # only set when unset
    result = launch("--nproc-per-node=1", "--local-addr=127.0.0.1", WORKER, "env")
    env = json.loads(by_rank(result.stdout)[0][0])
    assert env["OMP_NUM_THREADS"] == "1"
    assert env["AIODIST_HOST"] == "127.0.0.1"


@pytest.mark.parametrize(("visible", "expected"), [(None, ["0", "1"]), ("5,3,4", ["5", "3"])])
def test_virtual_local_rank_gives_each_worker_its_own_gpu(
    visible: str | None, expected: list[str]
) -> None:
    env = clean_env()
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    result = launch("--nproc-per-node=2", "--virtual-local-rank", WORKER, "env", env=env)
    assert result.returncode == 0, result.stderr
    envs = {r: json.loads(lines[0]) for r, lines in by_rank(result.stdout).items()}
    assert [envs[r]["CUDA_VISIBLE_DEVICES"] for r in (0, 1)] == expected
    assert [(envs[r]["RANK"], envs[r]["LOCAL_RANK"]) for r in (0, 1)] == [("0", "0"), ("1", "0")]


def test_log_line_prefix_template() -> None:
    result = launch(
        "--nproc-per-node=2", "--role=trainer", "--log-line-prefix-template=<${role_name}${rank}|${local_rank}>",
        WORKER, "stdio",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == [
        "<trainer0|0> out line of rank 0",
        "<trainer1|1> out line of rank 1",
    ]
    assert "<trainer1|1> err line of rank 1" in result.stderr.splitlines()


def test_compatibility_flags_are_accepted() -> None:
    result = launch(
        "--rdzv-backend=c10d", "--start-method=fork", "--rdzv-id=x", "--nnodes=1:1", WORKER, "env"
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(by_rank(result.stdout)[0][0])["TORCHELASTIC_RUN_ID"] == "x"
    with pytest.raises(SystemExit):
        get_args_parser().parse_args(["--rdzv-backend=zookeeper", "s.py"])


def test_standalone_picks_free_ports_concurrently() -> None:
    procs = [start("--standalone", "--nproc-per-node=2", WORKER, "env") for _ in range(3)]
    ports = set()
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        envs = [json.loads(v[0]) for v in by_rank(out).values()]
        assert len({e["MASTER_PORT"] for e in envs}) == 1
        assert len({e["TORCHELASTIC_RUN_ID"] for e in envs}) == 1
        ports.add(envs[0]["MASTER_PORT"])
    assert len(ports) == 3


def test_standalone_takes_the_master_port_and_says_where_the_store_is() -> None:
    port = free_port()
    result = launch("--standalone", f"--master-port={port}", "--nproc-per-node=2", WORKER, "env")
    assert result.returncode == 0, result.stderr
    envs = [json.loads(v[0]) for v in by_rank(result.stdout).values()]
    assert {e["MASTER_PORT"] for e in envs} == {str(port)}
    said = f"the job's store is at 127.0.0.1:{port} (python -m aiodist.debug status --store 127.0.0.1:{port})"
    assert f"[aiodist-run] INFO: {said}" in result.stderr.splitlines(), result.stderr
    # Without it, a free port, said all the same.
    result = launch("--standalone", WORKER, "env")
    picked = json.loads(by_rank(result.stdout)[0][0])["MASTER_PORT"]
    assert f"the job's store is at 127.0.0.1:{picked} " in result.stderr, result.stderr


_SHRINKING = """
import os
import aiodist.sync as dist

dist.init_process_group("gloo")
print(f"before: rank {dist.get_rank()}", flush=True)
if dist.get_rank() == 0:
    dist.destroy_process_group()
else:
    dist.shrink_group([0])
    print(f"after: rank {dist.get_rank()}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
"""


def test_output_lines_carry_the_rank_after_a_shrink(tmp_path: Path) -> None:
    script = tmp_path / "shrink.py"
    script.write_text(_SHRINKING)
    result = launch("--nproc-per-node=3", str(script))
    assert result.returncode == 0, result.stderr
    lines = sorted(result.stdout.splitlines())
    assert lines == [
        "[rank0]: after: rank 0",  # (local rank 1: rank 1, then rank 0)
        "[rank0]: before: rank 0",
        "[rank1]: after: rank 1",  # (local rank 2)
        "[rank1]: before: rank 1",
        "[rank2]: before: rank 2",
    ], result.stdout
    # The marks are taken out of both streams, and stderr follows the rank too.
    assert "aiodist-rank" not in result.stdout + result.stderr
    assert "\x1b" not in result.stdout + result.stderr


_MARKS = r"""
import os, sys
sys.stdout.write("unended ")
sys.stdout.flush()
os.write(1, b"\x1b]aiodist-rank;7\x07\n")
print("as rank 7", flush=True)
print("\x1b]aiodist-rank;not a mark", flush=True)
print("on stderr, still rank 0", file=sys.stderr, flush=True)
os.write(2, b"\x1b]aiodist-rank;5\x07\n")
print("on stderr as rank 5", file=sys.stderr, flush=True)
"""


def test_a_worker_says_its_new_rank_in_its_own_streams(tmp_path: Path) -> None:
    # What a worker writes as it joins a world under a new rank (_assembly._join.RANK_MARK):
    # each stream takes the new prefix exactly after the lines before the mark; a line the
    # script had not ended is printed as it was; anything else is left as written.
    script = tmp_path / "marks.py"
    script.write_text(_MARKS)
    result = launch("--nproc-per-node=1", str(script))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "[rank0]: unended ",
        "[rank7]: as rank 7",
        "[rank7]: \x1b]aiodist-rank;not a mark",
    ], result.stdout
    assert [line for line in result.stderr.splitlines() if line.startswith("[rank")] == [
        "[rank0]: on stderr, still rank 0",
        "[rank5]: on stderr as rank 5",
    ], result.stderr


def test_master_port_and_rdzv_endpoint() -> None:
    port = free_port()
    result = launch(f"--master-port={port}", "--nproc-per-node=2", WORKER, "allreduce")
    assert result.returncode == 0, result.stderr
    port = free_port()
    result = launch(f"--rdzv-endpoint=127.0.0.1:{port}", WORKER, "env")
    assert json.loads(by_rank(result.stdout)[0][0])["MASTER_PORT"] == str(port)


def test_master_port_in_use_is_a_clear_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = launch(f"--master-port={port}", WORKER, "env")
    assert result.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr
    assert "the port is in use" in result.stderr


def test_module_and_no_python(tmp_path: Path) -> None:
    result = launch(
        "--nproc-per-node=2", "-m", "launcher_worker", "env", env=clean_env(PYTHONPATH=str(HERE))
    )
    assert result.returncode == 0, result.stderr
    assert sorted(by_rank(result.stdout)) == [0, 1]
    script = tmp_path / "run.sh"
    script.write_text('#!/bin/sh\necho "shell rank $RANK of $WORLD_SIZE args $*"\n')
    script.chmod(0o755)
    result = launch("--nproc-per-node=2", "--no-python", str(script), "x", "y")
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {r: [f"shell rank {r} of 2 args x y"] for r in range(2)}


def test_missing_executable_is_reported() -> None:
    result = launch("--no-python", "/nonexistent/prog")
    assert result.returncode == 1
    assert "/nonexistent/prog" in result.stderr


def test_local_ranks_filter() -> None:
    result = launch("--nproc-per-node=3", "--local-ranks-filter=1", WORKER, "stdio")
    assert result.returncode == 0, result.stderr
    assert result.stdout == "[rank1]: out line of rank 1\n"
    assert "[rank1]: err line of rank 1\n" in result.stderr
    assert "rank0" not in result.stderr and "rank2" not in result.stderr


def test_log_dir_redirects_and_tee(tmp_path: Path) -> None:
    result = launch(
        "--nproc-per-node=2", f"--log-dir={tmp_path}", "--rdzv-id=r1", "-r", "1", "-t", "0:2",
        WORKER, "stdio",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    # stdout is redirected: only in the files. stderr of local rank 0 is teed: in both.
    assert "out line" not in result.stdout
    assert "[rank0]: err line of rank 0" in result.stderr
    assert "[rank1]: err line of rank 1" in result.stderr
    for rank in range(2):
        d = tmp_path / "r1" / "attempt_0" / str(rank)
        assert (d / "stdout.log").read_text() == f"out line of rank {rank}\n"
    assert (tmp_path / "r1/attempt_0/0/stderr.log").read_text() == "err line of rank 0\n"
    assert not (tmp_path / "r1/attempt_0/1/stderr.log").exists()


# -- failures ------------------------------------------------------------------------------------
def test_failure_names_first_failing_rank_and_stops_the_others() -> None:
    t0 = time.monotonic()
    result = launch("--nproc-per-node=4", WORKER, "fail", "2", "7")
    elapsed = time.monotonic() - t0
    assert result.returncode == 1
    assert elapsed < 20  # the others sleep 60 s: they were stopped
    summary = result.stderr[result.stderr.index("aiodist-run: the job failed") :]
    assert re.search(
        r"root cause: rank 2 \(local rank 2 on node 0, pid \d+\) failed first, with exit code 7",
        summary,
    )
    assert "last lines of rank 2's stderr:\n    failing on purpose" in summary
    assert "attempt 1 of 1 (--max-restarts=0)" in summary


def test_failure_summary_says_which_ranks_had_finished_before() -> None:
    result = launch("--nproc-per-node=3", WORKER, "finish-fail", "1", "5")
    assert result.returncode == 1
    summary = result.stderr[result.stderr.index("aiodist-run: the job failed") :]
    assert re.search(
        r"root cause: rank 1 \(local rank 1 on node 0, pid \d+\) failed first", summary
    )
    assert "ranks 0, 2 of node 0 had finished before (exit code 0): not a failure" in summary


def test_failure_summary_reads_the_error_file() -> None:
    result = launch("--nproc-per-node=2", WORKER, "errorfile", "1")
    assert result.returncode == 1
    summary = result.stderr[result.stderr.index("aiodist-run: the job failed") :]
    assert "root cause: rank 1" in summary
    assert "error: KeyError: 'the root cause'" in summary
    assert "traceback (from the worker's error file):" in summary
    assert 'raise KeyError("the root cause")' in summary


def children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie counts as dead.
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    return False


def test_worker_killed_by_signal_is_named() -> None:
    proc = start("--nproc-per-node=2", "--shutdown-timeout=1", WORKER, "ignore-term")
    wait_ready(proc, 2)
    workers = children(proc.pid)
    assert len(workers) == 2
    os.kill(min(workers), signal.SIGKILL)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert re.search(r"failed first, with signal SIGKILL \(9\)", err)


def test_restart_after_crash_with_fresh_store_state() -> None:
    result = launch("--nproc-per-node=3", "--max-restarts=1", WORKER, "crash-once", "1")
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {r: ["attempt=1 sum=6"] for r in range(3)}
    assert "attempt 0 failed: rank 1 (node 0) exited with exit code 3; restarting" in result.stderr


def test_restarts_exhausted() -> None:
    result = launch("--nproc-per-node=2", "--max-restarts=1", WORKER, "fail", "0", "4")
    assert result.returncode == 1
    assert (
        result.stderr.count("failing on purpose") == 2 + 1
    )  # twice on the console, once in the summary
    assert "attempt 2 of 2 (--max-restarts=1)" in result.stderr


def test_monitor_interval_bounds_remote_checks() -> None:
    # With a long monitor interval a failing worker is still noticed at once: exits are events.
    t0 = time.monotonic()
    result = launch("--monitor-interval=30", "--nproc-per-node=2", WORKER, "fail", "1", "5")
    assert result.returncode == 1
    assert time.monotonic() - t0 < 20


# -- signals -------------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signals_are_forwarded(sig: signal.Signals) -> None:
    proc = start("--nproc-per-node=3", WORKER, "signals")
    wait_ready(proc, 3)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig
    got = [line for line in out.splitlines() if "got" in line]
    assert sorted(got) == [f"[rank{r}]: got {sig.name}" for r in range(3)]
    assert f"received {sig.name}: stopping the workers" in err


def test_signals_to_handle() -> None:
    proc = start("--nproc-per-node=2", "--signals-to-handle=SIGUSR1,SIGTERM", WORKER, "signals")
    wait_ready(proc, 2)
    proc.send_signal(signal.SIGUSR1)
    out, _err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGUSR1
    assert sorted(line for line in out.splitlines() if "got" in line) == [
        "[rank0]: got SIGUSR1",
        "[rank1]: got SIGUSR1",
    ]


def test_sigterm_escalates_to_sigkill_after_shutdown_timeout() -> None:
    proc = start("--nproc-per-node=2", "--shutdown-timeout=1", WORKER, "ignore-term")
    wait_ready(proc, 2)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert 0.9 < time.monotonic() - t0 < 15
    assert "workers still running 1.0 s after SIGTERM: sending SIGKILL" in err


def test_killing_the_launcher_kills_its_workers() -> None:
    proc = start("--nproc-per-node=2", WORKER, "ignore-term")
    wait_ready(proc, 2)
    workers = children(proc.pid)
    assert len(workers) == 2
    proc.kill()
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 10
    while any(alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(w) for w in workers)


def test_redirects_without_log_dir_keep_a_temporary_one() -> None:
    result = launch("--nproc-per-node=2", "--rdzv-id=tmpjob", "-r", "3", WORKER, "stdio")
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    m = re.search(r"worker logs: (\S+)", result.stderr)
    assert m, result.stderr
    logs = Path(m[1])
    try:
        assert logs.name == "tmpjob"
        assert (logs / "attempt_0/1/stdout.log").read_text() == "out line of rank 1\n"
        assert (logs / "attempt_0/0/stderr.log").read_text() == "err line of rank 0\n"
    finally:
        shutil.rmtree(logs.parent)


def test_auth_token_protects_the_store_and_reaches_the_workers() -> None:
    result = launch(
        "--nproc-per-node=2", WORKER, "allreduce", env=clean_env(AIODIST_AUTH_TOKEN="s3cret")
    )
    assert result.returncode == 0, result.stderr
    assert by_rank(result.stdout) == {r: ["sum=3 expected=3"] for r in range(2)}
