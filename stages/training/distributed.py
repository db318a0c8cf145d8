"""Run a function in N processes under `accelerate launch`, owned and awaited by the calling stage.

    launch("stages.train:train_worker", args, num_processes=2, run_dir=work_dir / "launch", log=ctx.log)

starts `python -m accelerate.commands.launch --multi_gpu --num_processes N ... -m stages.training.distributed
run_dir/payload.json` in its own process group, streams every line the processes print into `log`,
waits, and returns what rank 0's function returned (JSON, through run_dir/result.json). `--multi_gpu` is
accelerate's torchrun launcher: one process per GPU, or on a machine without CUDA N CPU processes that
talk over gloo (accelerate's `--cpu` would start only one). Inside, `Accelerator()` reads the launcher's
environment (RANK, WORLD_SIZE, MASTER_PORT) and wraps the model in DDP. Several machines: each calls
`launch` with its `machine_rank` and machine 0's address and port (torchrun's rendezvous); a machine other
than 0 returns None. `share_folder` hands rank 0's files (a resume checkpoint) to the other machines.

Work a launched process saves (a checkpoint: `store.work_saved`) is published by the launching stage's process,
which holds the store: rank 0 prints one `finetune:work-saved <folder>` line and waits; the stage's process
reads it, calls `work_saved(folder)` there (on a shared store: the upload to `.work/<stage>-<key>/`, exactly as
in one process) and answers through run_dir/published.json. Other ranks never publish. Under several
machines that is machine 0's stage (global rank 0 runs there); the others commit nothing.

A failure becomes one stage error: a FinetuneError raised in a process (a config problem, a missing
input) is raised again here with its own class and message; anything else (a crash, a killed process)
is a LaunchError with the exit status, the last lines printed, and the fix. Interrupting the stage (Ctrl-C,
a cancelled flow run) terminates the whole process group.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import json
import logging
import os
import shutil
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
from stages.engine.errors import ConfigError, FinetuneError, MissingInputError
from stages.engine.paths import PROJECT_ROOT, work_root
from stages.engine.store import publishing_work, work_saved, write_json_atomic

TAIL_LINES = 25
SAVED = "finetune:work-saved "  # rank 0's line to its launcher: publish this folder of the work_dir
PUBLISHED = "published.json"  # the launcher's answer: {"folder": the folder it published}
POLL_S = 0.05


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


def launch_command(payload: Path, num_processes: int, port: int, config_file: Path | None = None, *,
                   num_machines: int = 1, machine_rank: int = 0, main_process_ip: str | None = None) -> list[str]:
    """The `accelerate launch` command line (accelerate's own defaults spelled out, so it prints no
    'values were not passed' warning; precision is set by the Accelerator inside). `num_processes` is
    this machine's; accelerate takes the total. Several machines: each runs this with its own
    `machine_rank` and the same `main_process_ip`:`port` (torchrun's static rendezvous, hosted by machine
    0). Flags given here win over the same settings in `config_file`."""
    config = ["--config_file", str(config_file)] if config_file else []
    machines = ["--machine_rank", str(machine_rank), "--main_process_ip", str(main_process_ip)] if num_machines > 1 else []
    return [sys.executable, "-m", "accelerate.commands.launch", *config, "--multi_gpu",
            "--num_processes", str(num_processes * num_machines), "--num_machines", str(num_machines), *machines,
            "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(port), "-m", "stages.training.distributed", str(payload)]


def joining(settings: Any, what: str = "train") -> str | None:
    """Stage.joins for a stage launched on several machines: on machine_rank > 0 its processes train with
    machine 0's, which commits (a line saying so); None on machine 0 or one machine."""
    if settings.num_machines > 1 and settings.machine_rank > 0:
        return (f"machine {settings.machine_rank} of {settings.num_machines}: {what} with machine 0 "
                f"({settings.main_process_ip}:{settings.main_process_port}), which writes the artifact")
    return None


def launch(target: str, args: dict[str, Any], num_processes: int, run_dir: Path, log: logging.Logger, *,
           port: int | None = None, config_file: str | Path | None = None, what: str = "train",
           pythonpath: Sequence[str] = (), num_machines: int = 1, machine_rank: int = 0,
           main_process_ip: str | None = None) -> Any:
    """Call `target` ("module:function") with `args` in each of `num_processes` processes on this machine;
    return rank 0's result (None on a machine other than 0, which has no rank 0). `config_file`: an
    `accelerate config` file (DDP); `what` names the stage in error messages; `pythonpath` is prepended
    for the processes. Several machines: `num_machines`, this one's `machine_rank`, and machine 0's
    `main_process_ip` and `port`, the same on every machine."""
    config = check_accelerate_config(config_file, what) if config_file else None
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [run_dir / "result.json", run_dir / PUBLISHED, *run_dir.glob("error-*.json")]:
        stale.unlink(missing_ok=True)
    payload = run_dir / "payload.json"
    payload.write_text(json.dumps({"target": target, "args": args, "run_dir": str(run_dir),
                                   "launcher_pid": os.getpid()}, indent=1))
    if num_machines > 1 and (port is None or main_process_ip is None):
        raise ConfigError(f"{what}.num_machines: {num_machines} machines need {what}.main_process_ip and "
                          f"{what}.main_process_port, the same on every machine")
    port = port or free_port()
    cmd = launch_command(payload, num_processes, port, config, num_machines=num_machines,
                         machine_rank=machine_rank, main_process_ip=main_process_ip)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*pythonpath, str(PROJECT_ROOT), *filter(None, [env.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // num_processes)))
    env["PYTHONUNBUFFERED"] = "1"
    where = (f"machine {machine_rank} of {num_machines}, rendezvous {main_process_ip}:{port}" if num_machines > 1
             else f"port {port}")
    log.info("%s: launching %d processes (%s): %s", what, num_processes, where, " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            cwd=work_root(), start_new_session=True)  # its own group: we can stop all of it
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            _, saved, folder = line.partition(SAVED)
            if saved:  # rank 0 saved a checkpoint and waits: publish it from here, then say so
                work_saved(Path(folder))
                write_json_atomic(run_dir / PUBLISHED, {"folder": folder})
            elif line:
                tail.append(line)
                log.info("%s", line)
        rc = proc.wait()
    except BaseException:
        _stop(proc)
        raise
    alone = f"{what}.num_processes=1" if num_machines == 1 else f"{what}.num_machines=1 and {what}.num_processes=1"
    raised = _raised_in_worker(run_dir, what, alone)
    if raised is not None:
        raise raised
    if rc != 0:
        raise LaunchError(
            f"{what}: the {num_processes}-process run under accelerate launch failed (exit status {rc}); its last "
            f"lines: {' | '.join(list(tail)[-8:])}. Fix the cause above (the full output is in the stage log), "
            f"or set {alone} to run in one process")
    if machine_rank > 0:
        return None  # rank 0, and with it the result, lives on machine 0
    result = run_dir / "result.json"
    if not result.is_file():
        raise LaunchError(f"{what}: the launched processes exited without a result from rank 0 ({result}); "
                          f"see the stage log, or set {alone}")
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


def _raised_in_worker(run_dir: Path, what: str, alone: str) -> FinetuneError | None:
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
                           f"(traceback in the stage log); {hint}set {alone} to run in one process")
    return None


# ---------------------------------------------------------------- inside each launched process

def hand_over(folder: Path, run_dir: Path, launcher_pid: int | None) -> None:
    """Rank 0's `work_saved`: ask the launching stage's process to publish `folder` and wait until it has (so
    the next checkpoint cannot remove the folder mid-upload, and a crash after this returns loses nothing
    published), as `work_saved` returns after the upload in one process."""
    done = run_dir / PUBLISHED
    print(f"{SAVED}{folder}", flush=True)
    while True:
        try:
            if json.loads(done.read_text()).get("folder") == str(folder):
                done.unlink()
                return
        except (FileNotFoundError, ValueError):
            pass
        if launcher_pid is not None and not _alive(launcher_pid):
            raise LaunchError(f"the stage process that launched this one ({launcher_pid}) is gone; {folder} was "
                              f"saved but not published")
        time.sleep(POLL_S)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:  # no such process (or another user's, which took its pid)
        return False
    return True


def share_folder(folder: Path | None, dest: Path, device: Any) -> Path | None:
    """Global rank 0's `folder` (or None) on every rank: the others receive a copy of its files under `dest`
    over the process group, for machines that do not see rank 0's disk (a resume checkpoint). Every rank
    calls it (a collective); `device` is where the backend's tensors live (CUDA for NCCL)."""
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    header, blob = b"", b""
    if rank == 0 and folder is not None:
        files = sorted(p for p in folder.rglob("*") if p.is_file())
        header = json.dumps({"name": folder.name,
                             "files": [[str(p.relative_to(folder)), p.stat().st_size] for p in files]}).encode()
        blob = b"".join(p.read_bytes() for p in files)
    sizes = torch.tensor([len(header), len(blob)], dtype=torch.long, device=device)
    dist.broadcast(sizes, 0)
    n_header, n_blob = sizes.tolist()
    if n_header == 0:
        return None
    parts = []
    for n, data in ((n_header, header), (n_blob, blob)):
        t = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device) if rank == 0
             else torch.empty(n, dtype=torch.uint8, device=device))
        if n:
            dist.broadcast(t, 0)
        parts.append(t.cpu().numpy().tobytes())
    if rank == 0:
        return folder
    spec = json.loads(parts[0])
    target = dest / spec["name"]
    if target.exists():
        shutil.rmtree(target)
    offset = 0
    for rel, size in spec["files"]:
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_bytes(parts[1][offset:offset + size])
        offset += size
    return target


def main(argv: list[str]) -> int:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # rank 0 tells the story; the others speak up only for warnings
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout, force=True,
                        format=f"[rank {rank}] %(levelname)s %(name)s: %(message)s")
    spec = json.loads(Path(argv[0]).read_text())
    run_dir = Path(spec["run_dir"])
    module, _, name = spec["target"].partition(":")
    # global rank 0 alone publishes what it saves, through the launcher; another rank's work_saved is a no-op
    publish = (publishing_work(lambda folder: hand_over(folder, run_dir, spec.get("launcher_pid"))) if rank == 0
               else contextlib.nullcontext())
    try:
        with publish:
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
