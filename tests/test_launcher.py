"""`tiers launch` without running a job: hostfiles and filters, the environment, and every launcher's exact command."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from engine.cli import main as tiers
from engine.launcher import LauncherKind, LaunchError, LaunchOptions, make_plan, node_commands, parse_hostfile
from engine.launcher.environment import parse_env_file
from engine.launcher.hosts import expand_nodelist, select_resources
from tests.distributed import free_port

HOSTFILE = """
# two workers and a login node
worker-1 slots=4
worker-2 slots=4   # the second
10.0.0.7 slots=2
"""
NASTY_ARGS = ("--name", "two words", "it's \"quoted\"", "a;rm -rf ~", "$HOME", "`id`", "")


@pytest.fixture(autouse=True)
def no_home_env_file(tmp_path, monkeypatch):
    """Only the .tiers_env files a test writes: not the developer's own."""
    monkeypatch.setenv("HOME", str(tmp_path))


def _pool():
    return parse_hostfile(HOSTFILE, "hostfile")


def _plan(tmp_path, launcher, *, environ=None, hostfile=HOSTFILE, **options):
    (tmp_path / "hostfile").write_text(hostfile)
    options = LaunchOptions(script="train.py", script_args=NASTY_ARGS, hostfile=str(tmp_path / "hostfile"),
                            launcher=LauncherKind(launcher), **options)
    return make_plan(options, environ=environ or {}, cwd=str(tmp_path / "job dir"))


def test_hostfile_keeps_order_and_slots_and_skips_comments():
    assert list(_pool().items()) == [("worker-1", 4), ("worker-2", 4), ("10.0.0.7", 2)]


@pytest.mark.parametrize("text, message", [
    ("worker-1 4\n", "line 1: expected 'hostname slots=N', got 'worker-1 4'"),
    ("worker-1 slots=2 gpus=2\n", "line 1: expected 'hostname slots=N'"),
    ("\n# c\nworker-1 slots=x\n", "line 3: expected 'hostname slots=N'"),
    ("worker-1 slots=0\n", "host 'worker-1' has slots=0"),
    ("worker-1 slots=2\nworker-1 slots=2\n", "line 2: host 'worker-1' is listed twice"),
    ("-oProxyCommand=sh slots=1\n", "'-oProxyCommand=sh' is not a host name"),
    ("a;reboot slots=1\n", "'a;reboot' is not a host name"),
    ("# nothing\n\n", "no hosts in it"),
])
def test_hostfile_errors_name_the_line_and_the_fix(text, message):
    with pytest.raises(LaunchError, match="^hostfile") as info:
        parse_hostfile(text, "hostfile")
    assert message in str(info.value)


def test_include_and_exclude_in_deepspeeds_form():
    pool = _pool()
    assert select_resources(pool, include="worker-2:1,0@worker-1") == {"worker-1": [0, 1, 2, 3], "worker-2": [0, 1]}
    assert list(select_resources(pool, include="10.0.0.7@worker-1:3")) == ["worker-1", "10.0.0.7"]  # file order
    assert select_resources(pool, include="worker-1:0@worker-1:2") == {"worker-1": [0, 2]}
    assert select_resources(pool, exclude="worker-1@worker-2:0,3") == {"worker-2": [1, 2], "10.0.0.7": [0, 1]}
    assert select_resources(pool, num_nodes=2, nproc_per_node=2) == {"worker-1": [0, 1], "worker-2": [0, 1]}


@pytest.mark.parametrize("options, message", [
    (dict(include="worker-3"), "--include 'worker-3': host 'worker-3' is not in the hostfile "
                               "(it has worker-1, worker-2, 10.0.0.7)"),
    (dict(exclude="worker-1:0@nobody"), "host 'nobody' is not in the hostfile"),
    (dict(include="worker-1:4"), "slot 4 exceeds host 'worker-1''s slots=4 (slots 0..3)"),
    (dict(include="10.0.0.7:1,2"), "slot 2 exceeds host '10.0.0.7''s slots=2"),
    (dict(include="worker-1:a"), "slots of 'worker-1' must be integers"),
    (dict(include="worker-1@@worker-2"), "an empty host between '@'s"),
    (dict(include="worker-1", exclude="worker-2"), "--include and --exclude cannot be used together"),
    (dict(exclude="worker-1@worker-2@10.0.0.7"), "leaves no slots on any host"),
    (dict(nproc_per_node=3), "--nproc_per_node 3 exceeds the 2 slot(s) of host '10.0.0.7'"),
    (dict(include="worker-1:0", nproc_per_node=2), "exceeds the 1 slot(s) of host 'worker-1'"),
    (dict(num_nodes=4), "--num_nodes 4: there are 3 host(s) to use"),
])
def test_filter_errors_are_named(options, message):
    with pytest.raises(LaunchError) as info:
        select_resources(_pool(), **options)
    assert message in str(info.value)


def test_slurm_node_lists_expand_in_order():
    assert expand_nodelist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_nodelist("r[1-2]n[0-1]") == ["r1n0", "r1n1", "r2n0", "r2n1"]
    assert expand_nodelist("node7") == ["node7"]
    with pytest.raises(LaunchError, match="cannot read the range"):
        expand_nodelist("gpu[a-b]")


def _remote_words(line: str) -> list[str]:
    """What the remote shell runs after `cd DIR &&`, as words."""
    cd, _, rest = line.partition(" && exec ")
    assert shlex.split(cd)[0] == "cd"
    return shlex.split(rest)


def test_ssh_commands_one_per_node_with_ranks_and_quoted_arguments(tmp_path):
    plan = _plan(tmp_path, "ssh", include="worker-1:1,2@worker-2", environ={"NCCL_DEBUG": "INFO", "HOME_X": "no"})
    commands = node_commands(plan)
    assert [c.name for c in commands] == ["node 'worker-1' (node_rank 0)", "node 'worker-2' (node_rank 1)"]
    for rank, command in enumerate(commands):
        ssh, host, line = command.argv[:-2], command.argv[-2], command.argv[-1]
        assert ssh == ("ssh", "-tt", "-o", "BatchMode=yes") and host == f"worker-{rank + 1}"
        assert shlex.split(line.partition(" && ")[0]) == ["cd", str(tmp_path / "job dir")]
        words = _remote_words(line)
        assert words[0] == "env" and "NCCL_DEBUG=INFO" in words and not any(w.startswith("HOME_X") for w in words)
        assert ("CUDA_VISIBLE_DEVICES=1,2" in words) == (rank == 0)  # only a subset of a host's slots is pinned
        run = words[words.index(sys.executable):]
        assert run == [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes=2",
                       f"--nproc_per_node={2 if rank == 0 else 4}", "--max_restarts=0", f"--node_rank={rank}",
                       "--master_addr=worker-1", "--master_port=29500", "train.py", *NASTY_ARGS]


def test_pdsh_runs_one_command_on_every_node_with_a_rendezvous(tmp_path):
    plan = _plan(tmp_path, "pdsh", num_nodes=2, nproc_per_node=2, master_port=6000)
    (command,) = node_commands(plan)
    assert command.env == {"PDSH_RCMD_TYPE": "ssh", "PDSH_SSH_ARGS_APPEND": "-tt"}  # remote hang-up when stopped
    assert command.name == "pdsh on worker-1,worker-2"
    assert command.argv[:6] == ("pdsh", "-S", "-f", "32", "-w", "worker-1,worker-2")
    words = _remote_words(command.argv[6])
    run = words[words.index(sys.executable):]
    assert run == [sys.executable, "-u", "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=2",
                   "--max_restarts=0", "--rdzv_backend=c10d", "--rdzv_endpoint=worker-1:6000",
                   f"--rdzv_id={plan.rdzv_id}", "train.py", *NASTY_ARGS]


def test_slurm_execs_an_argument_vector_without_a_shell(tmp_path):
    plan = _plan(tmp_path, "slurm", exclude="10.0.0.7", max_restarts=2)
    (command,) = node_commands(plan)
    argv = list(command.argv)
    assert argv[:7] == ["srun", "--nodes=2", "--ntasks=2", "--ntasks-per-node=1", "--nodelist=worker-1,worker-2",
                        "--kill-on-bad-exit=1", f"--chdir={tmp_path / 'job dir'}"]
    assert argv[7] == "env" and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in argv
    assert argv[argv.index(sys.executable):][4:] == [
        "--nnodes=2", "--nproc_per_node=4", "--max_restarts=2", "--rdzv_backend=c10d",
        "--rdzv_endpoint=worker-1:29500", f"--rdzv_id={plan.rdzv_id}", "train.py", *NASTY_ARGS]


def test_slurm_without_a_hostfile_reads_the_allocation(tmp_path):
    options = LaunchOptions(script="train.py", launcher=LauncherKind.SLURM)
    plan = make_plan(options, environ={"SLURM_JOB_NODELIST": "gpu[3-4]", "SLURM_GPUS_ON_NODE": "8"}, cwd=str(tmp_path))
    assert [(n.host, len(n.slots)) for n in plan.nodes] == [("gpu3", 8), ("gpu4", 8)] and plan.master_addr == "gpu3"
    with pytest.raises(LaunchError, match="SLURM_JOB_NODELIST, which is not set"):
        make_plan(options, environ={}, cwd=str(tmp_path))


def test_local_nodes_run_torchrun_here_with_fixed_ranks(tmp_path):
    plan = _plan(tmp_path, "local", hostfile="a slots=2\nb slots=2\n", max_restarts=0, master_port=7000)
    commands = node_commands(plan)
    assert [c.argv[6:10] for c in commands] == [
        ("--max_restarts=0", "--node_rank=0", "--master_addr=127.0.0.1", "--master_port=7000"),
        ("--max_restarts=0", "--node_rank=1", "--master_addr=127.0.0.1", "--master_port=7000")]
    assert all(c.env == {} for c in commands)
    restartable = node_commands(_plan(tmp_path, "local", hostfile="a slots=2\n", max_restarts=1))
    assert restartable[0].env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # see engine/topology.py


@pytest.mark.parametrize("launcher", ["ssh", "pdsh"])
def test_remote_launchers_need_a_hostfile(tmp_path, launcher):
    with pytest.raises(LaunchError, match=f"--launcher {launcher} starts remote nodes and needs --hostfile"):
        make_plan(LaunchOptions(script="t.py", launcher=LauncherKind(launcher)), environ={}, cwd=str(tmp_path))


def test_one_command_launchers_refuse_nodes_with_different_slots(tmp_path):
    with pytest.raises(LaunchError, match=r"different slots \(worker-1:0,1,2,3, worker-2:1\); .* --launcher ssh"):
        _plan(tmp_path, "pdsh", include="worker-1@worker-2:1")


def test_env_files_home_then_working_directory(tmp_path, monkeypatch):
    home, job = tmp_path / "home", tmp_path / "job dir"
    home.mkdir(), job.mkdir()
    monkeypatch.setenv("HOME", str(home))
    (home / ".tiers_env").write_text("# cluster defaults\nNCCL_IB_DISABLE=1\nDATA=/home/data\n")
    (job / ".tiers_env").write_text("DATA=/scratch/my data; x\n\nEMPTY=\n")
    plan = _plan(tmp_path, "ssh", environ={"NCCL_IB_DISABLE": "0", "PYTHONPATH": "/src"})
    assert plan.from_env_files == {"NCCL_IB_DISABLE": "1", "DATA": "/scratch/my data; x", "EMPTY": ""}
    words = _remote_words(node_commands(plan)[0].argv[-1])
    assert {"NCCL_IB_DISABLE=1", "DATA=/scratch/my data; x", "EMPTY=", "PYTHONPATH=/src"} <= set(words)
    local = node_commands(_plan(tmp_path, "local", environ={"PYTHONPATH": "/src"}))[0]
    assert local.env == {"NCCL_IB_DISABLE": "1", "DATA": "/scratch/my data; x", "EMPTY": ""}  # the rest is inherited


def test_env_file_errors_name_the_line():
    with pytest.raises(LaunchError, match=r"^f, line 2: expected KEY=VALUE .* got 'export X=1'"):
        parse_env_file("A=1\nexport X=1\n", "f")
    with pytest.raises(LaunchError, match="line 1"):
        parse_env_file("NO_EQUALS\n", "f")


def test_dry_run_prints_lines_a_shell_runs_with_the_same_arguments(tmp_path, capsys, monkeypatch):
    """The ssh line from --dry-run, read back as words, and its remote part run by a real /bin/sh as sshd would:
    torchrun starts the script, which sees exactly the arguments given, and the .tiers_env and NCCL_* values."""
    job = tmp_path / "job dir"
    job.mkdir()
    monkeypatch.setenv("HOME", str(tmp_path))
    (job / ".tiers_env").write_text("TIERS_TEST_VALUE=semi;colon 'quote'\n")
    (job / "hostfile").write_text("localhost slots=1\n")
    (job / "show.py").write_text("import json, os, sys\nprint('ARGS=' + json.dumps([sys.argv[1:], "
                                 "os.environ['TIERS_TEST_VALUE'], os.environ['NCCL_TEST_X'], os.environ['RANK']]))\n")
    monkeypatch.chdir(job)
    monkeypatch.setenv("NCCL_TEST_X", "a b")
    port = free_port()
    assert tiers(["launch", "--hostfile", "hostfile", "--launcher", "ssh", "--master_addr", "127.0.0.1",
                  "--master_port", str(port), "--dry-run", "show.py", *NASTY_ARGS]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("# ssh: 1 node(s), 1 process(es), master 127.0.0.1:") and lines[1].startswith("# node")
    argv = shlex.split(lines[2])
    assert argv[:5] == ["ssh", "-tt", "-o", "BatchMode=yes", "localhost"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TIERS_"))}
    done = subprocess.run(["/bin/sh", "-c", argv[5]], cwd="/", env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    shown = [line for line in done.stdout.splitlines() if line.startswith("ARGS=")]
    assert json.loads(shown[0][5:]) == [list(NASTY_ARGS), "semi;colon 'quote'", "a b", "0"], done.stdout


def test_launch_errors_exit_2_with_the_message(tmp_path, capsys):
    (tmp_path / "hf").write_text("a slots=2\n")
    assert tiers(["launch", "--hostfile", str(tmp_path / "hf"), "--include", "b", "x.py"]) == 2
    assert "tiers launch: --include 'b': host 'b' is not in the hostfile (it has a)" in capsys.readouterr().err
    assert tiers(["launch", "--hostfile", str(tmp_path / "missing"), "x.py"]) == 2
    assert f"--hostfile {tmp_path / 'missing'}: cannot read it" in capsys.readouterr().err


def test_scripts_launch_is_the_same_command(tmp_path):
    (tmp_path / "hf").write_text("a slots=1\nb slots=1\n")
    script = Path(__file__).resolve().parent.parent / "scripts" / "launch"
    done = subprocess.run([sys.executable, str(script), "--hostfile", "hf", "--launcher", "local", "--dry-run", "t.py",
                           "--x", "1 2"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("-m torch.distributed.run --nnodes=2") == 2 and "t.py --x '1 2'" in done.stdout


def test_the_default_launcher_is_ssh_with_a_hostfile_and_local_without(tmp_path):
    (tmp_path / "hf").write_text("a slots=1\n")
    with_hostfile = make_plan(LaunchOptions(script="t.py", hostfile=str(tmp_path / "hf")), environ={},
                              cwd=str(tmp_path))
    without = make_plan(LaunchOptions(script="t.py", nproc_per_node=3), environ={}, cwd=str(tmp_path))
    assert with_hostfile.launcher is LauncherKind.SSH and with_hostfile.master_addr == "a"
    assert (without.launcher is LauncherKind.LOCAL
            and [(n.host, n.slots) for n in without.nodes] == [("localhost", (0, 1, 2))])


def test_this_machines_cuda_visible_devices_is_not_sent_to_other_nodes(tmp_path):
    plan = _plan(tmp_path, "ssh", include="worker-1@worker-2:1",
                 environ={"CUDA_VISIBLE_DEVICES": "0", "CUDA_HOME": "/c"})
    first, second = (_remote_words(c.argv[-1]) for c in node_commands(plan))
    assert "CUDA_HOME=/c" in first and not any(w.startswith("CUDA_VISIBLE_DEVICES") for w in first)
    assert "CUDA_VISIBLE_DEVICES=1" in second  # the node's own slots


def test_an_empty_filter_is_an_error():
    with pytest.raises(LaunchError, match="--include is empty"):
        select_resources(_pool(), include=" ")


def test_failure_reports_of_pdsh_and_srun_name_the_host():
    from engine.launcher.commands import PDSH_FAILURE, SRUN_FAILURE
    pdsh = PDSH_FAILURE.match("pdsh@login1: worker-2: ssh exited with exit code 3\n")
    assert (pdsh.group("host"), pdsh.group("code")) == ("worker-2", "3")
    srun = SRUN_FAILURE.match("srun: error: gpu07: task 1: Exited with exit code 2\n")
    assert (srun.group("host"), srun.group("code")) == ("gpu07", "2")
    killed = SRUN_FAILURE.match("srun: error: gpu08: tasks 2-3: Killed\n")
    assert (killed.group("host"), killed.group("code")) == ("gpu08", None)
    assert PDSH_FAILURE.match("worker-2: Traceback (most recent call last):") is None


def _fake_tool(directory: Path, name: str, script: str) -> None:
    directory.mkdir(exist_ok=True)
    (directory / name).write_text("#!/bin/sh\n" + script)
    (directory / name).chmod(0o755)


def test_a_host_pdsh_reports_failed_is_named_and_pdsh_is_stopped(tmp_path, monkeypatch, capsys):
    """A stand-in pdsh (none is installed here) that prints pdsh's own report of a failed host, then waits as pdsh
    does for the other hosts: the launcher names the host and stops pdsh without waiting for it."""
    from engine.launcher import launch
    _fake_tool(tmp_path / "bin", "pdsh", "echo 'pdsh@login1: worker-2: ssh exited with exit code 5' >&2\nsleep 600\n")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}:{os.environ['PATH']}")
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "hf").write_text("worker-1 slots=1\nworker-2 slots=1\n")
    options = LaunchOptions(script="t.py", hostfile=str(tmp_path / "hf"), launcher=LauncherKind.PDSH)
    assert launch(options) == 5
    err = capsys.readouterr().err
    assert "tiers launch: node 'worker-2' under pdsh on worker-1,worker-2 failed with exit code 5" in err, err


def test_a_launcher_tool_that_is_not_installed_is_named(tmp_path, monkeypatch, capsys):
    from engine.launcher import launch
    monkeypatch.setenv("PATH", str(tmp_path))  # no ssh on it
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "hf").write_text("worker-1 slots=1\n")
    assert launch(LaunchOptions(script="t.py", hostfile=str(tmp_path / "hf"))) == 127
    assert "tiers launch: cannot start node 'worker-1' (node_rank 0): ssh: No such file or directory" in \
        capsys.readouterr().err


def test_the_launcher_starts_without_importing_torch(tmp_path):
    (tmp_path / "hf").write_text("a slots=1\n")
    code = ("import sys; from engine.cli import main; main(['launch', '--hostfile', 'hf', '--dry-run', 't.py']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parent.parent)))
    assert done.returncode == 0, done.stderr
