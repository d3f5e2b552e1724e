"""scripts/slurm_fit.sbatch: valid bash, and its resources and srun line agree with the config it trains."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

from app.cli import cli_main

SCRIPT = Path("scripts/slurm_fit.sbatch")


def _sbatch_options(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([\w-]+)=(\S+)", text, flags=re.M))


def _srun_command(text: str, variables: dict[str, str]) -> list[str]:
    """The srun line with its continuations joined and the shell variables it uses filled in."""
    (line,) = re.findall(r"^srun .*?(?<!\\)$", text.replace("\\\n", " "), flags=re.M)
    for name, value in variables.items():
        line = line.replace(f'"${{{name}}}"', value)
    return shlex.split(line.replace('"$@"', ""))


def test_the_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_srun_launches_one_task_per_device_of_the_config(capsys):
    text = SCRIPT.read_text()
    options = _sbatch_options(text)
    assert options["signal"] == "SIGUSR1@90" and "#SBATCH --requeue" in text
    (config,) = re.findall(r"^CONFIG=\$\{CONFIG:-(\S+)\}$", text, flags=re.M)
    command = _srun_command(text, {"CONFIG": config, "SLURM_JOB_NUM_NODES": options["nodes"]})
    assert command[:2] == ["srun", "--kill-on-bad-exit=1"]
    app_args = command[command.index("app") + 1 :]
    assert app_args[-2:] == ["--ckpt_path", "last"]  # a requeued job resumes

    try:
        cli_main([*app_args[:-2], "--print_config"])
    except SystemExit as exit_info:
        assert exit_info.code in (0, None)
    trainer = yaml.safe_load(capsys.readouterr().out)["trainer"]
    assert trainer["devices"] == int(options["ntasks-per-node"]) == int(options["gpus-per-node"])
    assert trainer["devices"] * trainer["num_nodes"] == int(options["nodes"]) * int(options["ntasks-per-node"])


def _environment_srun_sees(tmp_path: Path, **variables: str) -> dict[str, str]:
    """Runs the script with SLURM's variables and a stand-in ``srun`` on PATH that records its environment."""
    srun = tmp_path / "srun"
    srun.write_text(f"#!/bin/sh\nenv > {tmp_path / 'srun.env'}\n")
    srun.chmod(0o755)
    slurm = {"SLURM_JOB_ID": "4242", "SLURM_NTASKS": "16", "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_PER_TASK": "8"}
    base = {"PATH": f"{tmp_path}:/usr/bin:/bin", "HOME": str(tmp_path)}
    subprocess.run(["bash", str(SCRIPT)], check=True, env={**base, **slurm, **variables}, capture_output=True)
    return dict(line.split("=", 1) for line in (tmp_path / "srun.env").read_text().splitlines() if "=" in line)


def test_srun_gets_the_cpus_per_task_and_no_interface_is_forced(tmp_path):
    seen = _environment_srun_sees(tmp_path)
    assert seen["SRUN_CPUS_PER_TASK"] == "8"  # Slurm >= 22.05 does not pass --cpus-per-task to srun
    assert seen["OMP_NUM_THREADS"] == "8"
    # NCCL's own choice (InfiniBand first) unless the user names an interface.
    assert "NCCL_SOCKET_IFNAME" not in seen and "GLOO_SOCKET_IFNAME" not in seen
    assert "MASTER_PORT" not in seen  # the app's port of the job and step (app/distributed/launch.py)


def test_net_ifname_sets_the_interface_of_nccl_and_gloo(tmp_path):
    seen = _environment_srun_sees(tmp_path, NET_IFNAME="ib0")
    assert seen["NCCL_SOCKET_IFNAME"] == seen["GLOO_SOCKET_IFNAME"] == "ib0"
    seen = _environment_srun_sees(tmp_path, NET_IFNAME="ib0", GLOO_SOCKET_IFNAME="eth0")
    assert (seen["NCCL_SOCKET_IFNAME"], seen["GLOO_SOCKET_IFNAME"]) == ("ib0", "eth0")
