"""Run a function in N processes under `accelerate launch`, owned and awaited by the calling stage.

    launch("stages.train:train_worker", args, num_processes=2, run_dir=work_dir / "launch", log=ctx.log)

starts `python -m accelerate.commands.launch --multi_gpu --num_processes N ... -m stages.common.distributed
run_dir/payload.json` in its own process group, streams every line the processes print into `log`,
waits, and returns what rank 0's function returned (JSON, through run_dir/result.json). `--multi_gpu` is
accelerate's torchrun launcher: one process per GPU, or on a machine without CUDA N CPU processes that
talk over gloo (accelerate's `--cpu` would start only one). Inside, `Accelerator()` reads the launcher's
environment (RANK, WORLD_SIZE, MASTER_PORT) and wraps the model in DDP.

A failure becomes one stage error: a FinetuneError raised in a process (a config problem, a missing
input) is raised again here with its own class and message; anything else (a crash, a killed process)
is a LaunchError with the exit status, the last lines printed, and the fix. Interrupting the stage (Ctrl-C,
a cancelled flow run) terminates the whole process group.
"""

from __future__ import annotations

import collections
import importlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from stages.engine import errors
from stages.engine.config import PROJECT_ROOT
from stages.engine.errors import ConfigError, FinetuneError, MissingInputError
from stages.engine.store import write_json_atomic

TAIL_LINES = 25


class LaunchError(FinetuneError):
    """The processes started with `accelerate launch` failed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def check_accelerate_config(path: str | Path, what: str = "train") -> Path:
    """An `accelerate config` file for the launch (machine settings: gpu_ids, NCCL, ...). Its
    distributed_type must be DDP (MULTI_GPU, or MULTI_CPU): FSDP and DeepSpeed shard weights and optimizer
    state, and the train loop's checkpoints, rank-0 validation and artifact assume whole copies."""
    import yaml

    file = Path(path).expanduser()
    if not file.is_file():
        raise MissingInputError(f"{what}.accelerate_config: {file} not found; write one with `accelerate config "
                                f"--config_file {file}`, or set it to null")
    try:
        doc = yaml.safe_load(file.read_text()) or {}  # accelerate writes YAML or JSON; YAML reads both
    except yaml.YAMLError as e:
        raise ConfigError(f"{what}.accelerate_config: {file} is not valid YAML/JSON ({e}); fix it") from None
    kind = str(doc.get("distributed_type", "NO")).upper() if isinstance(doc, dict) else "?"
    if kind not in ("NO", "MULTI_GPU", "MULTI_CPU"):
        raise ConfigError(f"{what}.accelerate_config: {file} sets distributed_type {kind}; the train stage runs "
                          f"DDP only (MULTI_GPU, or MULTI_CPU): FSDP / DeepSpeed sharded checkpoints are not "
                          f"supported yet; use a DDP config or set {what}.accelerate_config to null")
    if isinstance(doc, dict) and doc.get("use_cpu"):
        raise ConfigError(f"{what}.accelerate_config: {file} sets use_cpu: true, with which accelerate launch starts "
                          f"one process; remove it (without CUDA the processes train on CPU over gloo anyway)")
    return file


def launch_command(payload: Path, num_processes: int, port: int, config_file: Path | None = None) -> list[str]:
    """The `accelerate launch` command line (accelerate's own defaults spelled out, so it prints no
    'values were not passed' warning; precision is set by the Accelerator inside). Flags given here win
    over the same settings in `config_file`."""
    config = ["--config_file", str(config_file)] if config_file else []
    return [sys.executable, "-m", "accelerate.commands.launch", *config, "--multi_gpu",
            "--num_processes", str(num_processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port), "-m", "stages.common.distributed", str(payload)]


def launch(target: str, args: dict[str, Any], num_processes: int, run_dir: Path, log: logging.Logger, *,
           port: int | None = None, config_file: str | Path | None = None, what: str = "train",
           pythonpath: Sequence[str] = ()) -> Any:
    """Call `target` ("module:function") with `args` in each of `num_processes` processes; return rank 0's
    result. `config_file`: an `accelerate config` file (DDP); `what` names the stage in error messages;
    `pythonpath` is prepended for the processes."""
    config = check_accelerate_config(config_file, what) if config_file else None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [run_dir / "result.json", *run_dir.glob("error-*.json")]:
        stale.unlink(missing_ok=True)
    payload = run_dir / "payload.json"
    payload.write_text(json.dumps({"target": target, "args": args, "run_dir": str(run_dir)}, indent=1))
    port = port or free_port()
    cmd = launch_command(payload, num_processes, port, config)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_processes)))
    env["PYTHONUNBUFFERED"] = "1"
    log.info("%s: launching %d processes (port %d): %s", what, num_processes, port, " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=PROJECT_ROOT, start_new_session=True)  # its own group: we can stop all of it
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                log.info("%s", line)
        rc = proc.wait()
    except BaseException:
        _stop(proc)
        raise
    raised = _raised_in_worker(run_dir, what)
    if raised is not None:
        raise raised
    if rc != 0:
        raise LaunchError(
            f"{what}: the {num_processes}-process run under accelerate launch failed (exit status {rc}); its last "
            f"lines: {' | '.join(list(tail)[-8:])}. Fix the cause above (the full output is in the stage log), "
            f"or set {what}.num_processes=1 to run in one process")
    result = run_dir / "result.json"
    if not result.is_file():
        raise LaunchError(f"{what}: the launched processes exited without a result from rank 0 ({result}); "
                          f"see the stage log, or set {what}.num_processes=1")
    return json.loads(result.read_text())


def _stop(proc: subprocess.Popen, grace: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _raised_in_worker(run_dir: Path, what: str) -> FinetuneError | None:
    """The first error a process reported (the cause; the others' errors follow from it, e.g. a lost
    peer): a FinetuneError rebuilt with its own class, anything else a LaunchError naming it and the fix."""
    reports = [json.loads(p.read_text()) for p in run_dir.glob("error-*.json")]
    for info in sorted(reports, key=lambda r: (r["time"], r["rank"]))[:1]:
        where = f"process {info['rank']} of {info['world']}"
        cls = getattr(errors, info["type"], None)
        if isinstance(cls, type) and issubclass(cls, FinetuneError):
            return cls(f"{info['message']} (raised in {where})")
        hint = (f"lower {what}.micro_batch_size (the out-of-memory back-off works in one process only), or "
                if "out of memory" in info["message"].lower() else "fix the cause, or ")
        return LaunchError(f"{what}: {where} under accelerate launch failed with {info['type']}: {info['message']} "
                           f"(traceback in the stage log); {hint}set {what}.num_processes=1 to run in one process")
    return None


# ---------------------------------------------------------------- inside each launched process

def main(argv: list[str]) -> int:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # rank 0 tells the story; the others speak up only for warnings
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout, force=True,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    run_dir = Path(spec["run_dir"])
    module, _, name = spec["target"].partition(":")
    try:
        result = getattr(importlib.import_module(module), name)(spec["args"])
    except FinetuneError as err:
        write_json_atomic(run_dir / f"error-{rank:03d}.json", {"type": type(err).__name__, "message": str(err),
                                                          "rank": rank, "world": world, "time": time.time()})
        logging.getLogger("finetune.distributed").error("%s", err)
        return err.exit_code
    except Exception as err:
        traceback.print_exc(file=sys.stdout)
        write_json_atomic(run_dir / f"error-{rank:03d}.json", {"type": type(err).__name__, "message": str(err),
                                                          "rank": rank, "world": world, "time": time.time()})
        return 1
    if rank == 0:
        write_json_atomic(run_dir / "result.json", result)
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()  # nobody leaves (and tears down the group) before rank 0 has written everything
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
