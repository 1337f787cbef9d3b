"""Rollout buffer: a standalone trajectory server between agent/generator code and slime's trainer.

Generators (discovered in `generator/*.py` by their `TASK_TYPE`) produce trajectories against an OpenAI-compatible
engine URL and POST them to `/buffer/write`; slime's `rollout_buffer_example.generate_rollout` drains complete groups
with `/get_rollout_data`. Run it with

    python -m slime_plugins.rollout_buffer.buffer --host 127.0.0.1 --port 8889

It binds 127.0.0.1 by default (slime used 0.0.0.0): pass `--host 0.0.0.0` only on a trusted network, since anyone
who can reach the port can write trajectories or start generators.
"""

import argparse
import glob
import importlib.util
import os
import threading
import time
import traceback
from typing import Any, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

GENERATOR_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "generator")
REQUIRED_ITEM_KEYS = ("instance_id",)


def default_is_valid_group(group, min_valid_group_size, task_type) -> bool:
    """A group (instance_id, samples) is ready once it holds `min_valid_group_size` samples."""
    _instance_id, samples = group
    return len(samples) >= min_valid_group_size


def default_transform_group(group, task_type):
    return group


def default_get_group_data_meta_info(temp_data: dict) -> dict:
    """Summary of the groups being returned: sizes and mean reward (raw reward when the generator kept one)."""
    meta = {"total_samples": 0, "num_groups": len(temp_data)}
    rewards = []
    for samples in temp_data.values():
        meta["total_samples"] += len(samples)
        for s in samples:
            r = s.get("raw_reward", s.get("reward"))
            if isinstance(r, (int, float)):
                rewards.append(float(r))
    meta["avg_group_size"] = meta["total_samples"] / len(temp_data) if temp_data else 0.0
    meta["avg_reward"] = sum(rewards) / len(rewards) if rewards else 0.0
    return meta


class BufferQueue:
    """Trajectories grouped by `instance_id`; `get()` removes and returns every group that passes `is_valid_group`.

    A group that is full (`group_size` samples) but still rejected is dropped and counted in `dropped_groups`.
    """

    def __init__(
        self,
        group_size: int,
        task_type: str = "math",
        transform_group_func: Optional[Callable] = None,
        is_valid_group_func: Optional[Callable] = None,
        get_group_data_meta_info_func: Optional[Callable] = None,
    ):
        if group_size < 1:
            raise ValueError(f"group_size (num_repeat_per_sample) must be >= 1, got {group_size}")
        self.group_size = group_size
        self.task_type = task_type
        self.transform_group = transform_group_func or default_transform_group
        self.is_valid_group = is_valid_group_func or default_is_valid_group
        self.get_group_data_meta_info = get_group_data_meta_info_func or default_get_group_data_meta_info
        self.temp_data: dict[Any, list[dict]] = {}
        self.group_timestamps: dict[Any, float] = {}
        self.dropped_groups = 0
        self._lock = threading.Lock()

    def append(self, item: dict):
        missing = [k for k in REQUIRED_ITEM_KEYS if k not in item]
        if missing:
            raise ValueError(f"trajectory has no {missing} key(s); got keys {sorted(item)}")
        with self._lock:
            self.temp_data.setdefault(item["instance_id"], []).append(item)
            self.group_timestamps[item["instance_id"]] = time.time()

    def __len__(self):
        with self._lock:
            return sum(len(v) for v in self.temp_data.values())

    def get(self) -> dict:
        """{"data": [items of every ready group, oldest group first], "meta_info": {..., "finished_groups": [ids]}}."""
        with self._lock:
            ready = {}
            for instance_id in sorted(self.temp_data, key=lambda i: self.group_timestamps[i]):
                group = (instance_id, self.temp_data[instance_id])
                if self.is_valid_group(group, self.group_size, self.task_type):
                    ready[instance_id] = self.temp_data.pop(instance_id)
                    self.group_timestamps.pop(instance_id)
                elif len(group[1]) >= self.group_size:  # full yet rejected: it can never become valid
                    self.temp_data.pop(instance_id)
                    self.group_timestamps.pop(instance_id)
                    self.dropped_groups += 1
        data = []
        for instance_id in list(ready):
            _, samples = self.transform_group((instance_id, ready[instance_id]), self.task_type)
            ready[instance_id] = samples
            data.extend(samples)
        meta = self.get_group_data_meta_info(ready)
        meta["finished_groups"] = list(ready)
        meta["dropped_groups"] = self.dropped_groups
        return {"data": data, "meta_info": meta}


def discover_generators(generator_dirs=(GENERATOR_DIR,)) -> dict:
    """{TASK_TYPE: module} for every `*.py` defining TASK_TYPE and run_rollout(data). Duplicate task types are an error."""
    found = {}
    for d in generator_dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.py"))):
            if os.path.basename(path).startswith("_"):
                continue
            name = f"rollout_buffer_generator_{os.path.splitext(os.path.basename(path))[0]}"
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            task_type = getattr(module, "TASK_TYPE", None)
            if task_type is None or not callable(getattr(module, "run_rollout", None)):
                continue
            if task_type in found:
                raise ValueError(
                    f"generators {found[task_type].__file__} and {path} both declare TASK_TYPE={task_type!r}"
                )
            found[task_type] = module
    return found


class RolloutBuffer:
    """Server state: the queue, the generator registry and the one background rollout."""

    def __init__(self, group_size: int = 8, task_type: str = "math", generator_dirs=(GENERATOR_DIR,)):
        self.generators = discover_generators(generator_dirs)
        self.queue = self._make_queue(group_size, task_type)
        self.rollout_thread: Optional[threading.Thread] = None
        self.rollout_error: Optional[str] = None
        self.rollout_finished = False

    def _make_queue(self, group_size, task_type):
        module = self.generators.get(task_type)
        return BufferQueue(
            group_size,
            task_type,
            transform_group_func=getattr(module, "transform_group", None),
            is_valid_group_func=getattr(module, "is_valid_group", None),
            get_group_data_meta_info_func=getattr(module, "get_group_data_meta_info", None),
        )

    def start_rollout(self, payload: dict):
        task_type = payload.get("task_type", "math")
        if task_type not in self.generators:
            raise KeyError(
                f"no generator for task_type {task_type!r}; known: {sorted(self.generators)} "
                f"(a generator is a generator/*.py module with TASK_TYPE and run_rollout(data))"
            )
        if self.rollout_thread is not None and self.rollout_thread.is_alive():
            raise RuntimeError(
                "a rollout is already running on this buffer; start a new buffer server for another one"
            )
        group_size = int(payload.get("num_repeat_per_sample", self.queue.group_size))
        if len(self.queue) == 0 or (group_size, task_type) != (self.queue.group_size, self.queue.task_type):
            self.queue = self._make_queue(group_size, task_type)
        self.rollout_error, self.rollout_finished = None, False
        run = self.generators[task_type].run_rollout

        def target():
            try:
                run(payload)
            except Exception:
                self.rollout_error = traceback.format_exc()
                print(f"rollout buffer: generator {task_type!r} failed:\n{self.rollout_error}", flush=True)
            finally:
                self.rollout_finished = True

        self.rollout_thread = threading.Thread(target=target, name=f"rollout-{task_type}", daemon=True)
        self.rollout_thread.start()


def create_app(group_size: int = 8, task_type: str = "math", generator_dirs=(GENERATOR_DIR,)) -> FastAPI:
    app = FastAPI(title="slime rollout buffer")
    state = RolloutBuffer(group_size, task_type, generator_dirs)
    app.state.buffer = state

    @app.post("/buffer/write")
    async def write_to_buffer(request: Request):
        item = await request.json()
        try:
            state.queue.append(item)
        except ValueError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=400)
        return {"success": True, "message": "written", "instance_id": item["instance_id"]}

    @app.post("/get_rollout_data")
    async def get_rollout_data(request: Request):
        result = state.queue.get()
        status = {
            "generator_running": bool(state.rollout_thread and state.rollout_thread.is_alive()),
            "generator_finished": state.rollout_finished,
            "generator_error": state.rollout_error,
            "buffered_samples": len(state.queue),
        }
        if not result["data"]:
            msg = "no complete group yet"
            if state.rollout_error:
                msg = f"the generator failed, no more data will come: {state.rollout_error.strip().splitlines()[-1]}"
            return {"success": False, "message": msg, "data": result, **status}
        return {"success": True, "message": f"{result['meta_info']['num_groups']} groups", "data": result, **status}

    @app.post("/start_rollout")
    async def start_rollout(request: Request):
        payload = await request.json()
        try:
            state.start_rollout(payload)
        except KeyError as e:
            return JSONResponse({"success": False, "message": e.args[0]}, status_code=400)
        except RuntimeError as e:
            return JSONResponse({"success": False, "message": str(e)}, status_code=409)
        return {"success": True, "message": f"rollout of task_type {payload.get('task_type', 'math')!r} started"}

    @app.get("/health")
    async def health():
        return {"status": "ok", "buffered_samples": len(state.queue), "task_types": sorted(state.generators)}

    return app


def main(argv=None):
    import uvicorn  # heavy: only the server's main

    p = argparse.ArgumentParser(description="slime rollout buffer server")
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1 by default; 0.0.0.0 exposes it)")
    p.add_argument("--port", type=int, default=8889)
    p.add_argument("--group-size", type=int, default=8, help="samples per group until /start_rollout sets it")
    p.add_argument("--task-type", default="math")
    p.add_argument(
        "--generator-dir",
        action="append",
        default=[],
        help="extra directory of generator modules (repeatable); generator/ is always scanned",
    )
    a = p.parse_args(argv)
    app = create_app(a.group_size, a.task_type, (GENERATOR_DIR, *a.generator_dir))
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
