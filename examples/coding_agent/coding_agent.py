"""A coding agent: the policy edits a small repository in a sandbox through tools, and tests in a clean sandbox grade it.

`generate(args, sample, sampling_params)` is a slime custom generate function. An episode:

1. The task's files (source and tests) are written into a fresh `slime.agent.sandbox.LocalSandbox`.
2. The policy works through `slime.agent.adapters.OpenAIAdapter` with three tools on that sandbox:
   `read_file(path)`, `write_file(path, content)` and `run(command)`. A command that runs past `TOOL_TIMEOUT_S`
   is killed (its whole process group) and the model is told so; a crash is its exit code and output. Neither
   ends the episode. Every tool call is recorded in the samples' metadata (`tool_log`, `tool_timeouts`).
3. Grading: the task's editable files, as the agent left them, are copied into a second, clean sandbox together
   with the task's own tests (the agent's copies of the tests are ignored, so editing them gains nothing), and
   `test_cmd` runs there under `GRADE_TIMEOUT_S`. Reward 1.0 when it exits 0, else 0.

The session's turns become loss-masked samples (one per branch, sharing the prompt's rollout_id).

Task (the sample's `metadata["task"]`): `files` ({path: text}, the files the agent may change), `tests`
({path: text}), `test_cmd` (a shell command; exit 0 means solved).
"""

import json
import logging
import uuid

import openai
from transformers import AutoTokenizer

from slime.agent.adapters import OpenAIAdapter
from slime.agent.aiohttp_threaded import run_app_in_thread
from slime.agent.sandbox import Limits, LocalSandbox
from slime.backends.sglang_utils.router import router_url
from slime.utils.lora_utils import generate_fields
from slime.utils.top_p_replay import sampling_is_truncated
from slime.utils.types import Sample

logger = logging.getLogger(__name__)

MAX_STEPS = 8  # policy turns per episode
TOOL_TIMEOUT_S = 10.0  # one `run` call
GRADE_TIMEOUT_S = 60.0  # the test command in the clean sandbox
MAX_TOOL_OUTPUT = 2000  # characters of a tool result the model sees (the tail)
TOOL_PARSER, REASONING_PARSER = "qwen25", "qwen3"  # the Qwen3 family's formats
# Short on purpose: the CPU test's tiny policy has a 512-token context.
SYSTEM_PROMPT = "Fix the code. Use the tools."
SANDBOX_LIMITS = Limits(timeout_s=GRADE_TIMEOUT_S, cpu_s=60, memory_bytes=2 << 30)
# Python's bytecode cache is keyed by a source's mtime (seconds) and size: a fix written in the same second as a
# run, at the same length (`a - b` -> `a + b`), would run the stale cached code.
RUN_ENV = {"PYTHONDONTWRITEBYTECODE": "1"}


def _tool(name, description, **params):
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {k: {"type": "string", "description": d} for k, d in params.items()},
                "required": list(params),
            },
        },
    }


TOOLS = [
    _tool("read_file", "Read a file of the repository.", path="relative path"),
    _tool("write_file", "Write a file of the repository (replaces it).", path="relative path", content="new text"),
    _tool("run", "Run a shell command in the repository.", command="the command"),
]


async def run_tool(sandbox, name: str, arguments) -> dict:
    """Run one tool call on the sandbox; never raises. Returns {name, arguments, result, timed_out}."""
    event = {"name": name, "arguments": arguments, "timed_out": False}
    try:
        args = json.loads(arguments or "{}") if isinstance(arguments, str) else arguments
        if not isinstance(args, dict):
            raise TypeError("the arguments must be an object")
        if name == "read_file":
            event["result"] = (await sandbox.read_file(str(args["path"]))).decode(errors="replace")[-MAX_TOOL_OUTPUT:]
        elif name == "write_file":
            data = str(args["content"]).encode()
            await sandbox.write_file(str(args["path"]), data)
            event["result"] = f"wrote {len(data)} bytes to {args['path']}"
        elif name == "run":
            r = await sandbox.exec(str(args["command"]), timeout=TOOL_TIMEOUT_S, env=RUN_ENV)
            if r.timed_out:
                event["timed_out"] = True
                event["result"] = f"error: timed out after {TOOL_TIMEOUT_S:g}s"
            else:
                event["result"] = f"exit {r.returncode}\n{(r.stdout + r.stderr)[-MAX_TOOL_OUTPUT:]}".rstrip()
        else:
            event["result"] = f"error: unknown tool {name!r}"
    except json.JSONDecodeError as e:
        event["result"] = f"error: the arguments are not JSON ({e.msg})"
    except KeyError as e:
        event["result"] = f"error: missing argument {e.args[0]!r}"
    except (OSError, ValueError, TypeError) as e:  # a path outside the sandbox, a missing file, a too large write
        event["result"] = f"error: {e}"
    return event


async def grade(task: dict, candidate: dict[str, str]) -> tuple[float, dict]:
    """Run the task's tests on the candidate's editable files in a clean sandbox: (reward, what happened)."""
    async with LocalSandbox(limits=SANDBOX_LIMITS) as sb:
        for path, text in {**task["files"], **candidate, **task["tests"]}.items():
            await sb.write_file(path, text)
        r = await sb.exec(task["test_cmd"], timeout=GRADE_TIMEOUT_S, env=RUN_ENV)
    passed = r.returncode == 0 and not r.timed_out
    return (1.0 if passed else 0.0), {
        "returncode": r.returncode,
        "timed_out": r.timed_out,
        "output": (r.stdout + r.stderr)[-MAX_TOOL_OUTPUT:],
    }


async def collect_candidate(sandbox, task: dict) -> dict[str, str]:
    """The task's editable files as the agent left them (a deleted one is left out: the task's copy is used)."""
    out = {}
    for path in task["files"]:
        try:
            out[path] = (await sandbox.read_file(path)).decode(errors="replace")
        except OSError:
            pass
    return out


_state = {}


def _adapter(args):
    """One adapter per rollout process, serving on a background thread, over the router."""
    if "adapter" not in _state:
        adapter = OpenAIAdapter(
            tokenizer=AutoTokenizer.from_pretrained(args.hf_checkpoint, trust_remote_code=True),
            sglang_url=router_url(args),  # the adapter records each turn itself: no hop through the proxy
            tool_parser=TOOL_PARSER,
            reasoning_parser=REASONING_PARSER,
            generate_fields=generate_fields(args),
            # top-p replay: each turn's kept token sets, asked of a worker directly (the router drops the field)
            return_kept_sets=sampling_is_truncated(args),
            worker_api_key=args.sglang_api_key,
        )
        _state["adapter"], _state["handle"] = adapter, run_app_in_thread(adapter.app)
    return _state["adapter"], _state["handle"].url


async def generate(args, sample: Sample, sampling_params, evaluation=False) -> list[Sample]:
    task = sample.metadata["task"]
    adapter, url = _adapter(args)
    session_id = f"code-{sample.index}-{uuid.uuid4().hex[:8]}"
    defaults = {k: v for k, v in sampling_params.items() if v is not None}
    max_context = (args.eval_max_context_len if evaluation else args.rollout_max_context_len) or 0
    adapter.open_session(session_id, sampling_defaults=defaults, max_context_tokens=max_context)
    client = openai.AsyncOpenAI(api_key=session_id, base_url=url + "/v1", max_retries=0)
    prompt = sample.prompt
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    messages += [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
    tool_log, error, aborted = [], None, False
    async with LocalSandbox(limits=SANDBOX_LIMITS) as sandbox:
        for path, text in {**task["files"], **task["tests"]}.items():
            await sandbox.write_file(path, text)
        try:
            for _ in range(MAX_STEPS):
                r = await client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
                msg = r.choices[0].message
                messages.append(msg.model_dump(exclude_none=True))
                if not msg.tool_calls:
                    break
                for call in msg.tool_calls:
                    event = await run_tool(sandbox, call.function.name, call.function.arguments)
                    tool_log.append(event)
                    messages.append({"role": "tool", "tool_call_id": call.id, "content": event["result"]})
        except openai.APIStatusError as e:  # e.g. the history outgrew the context: the episode ends, its turns train
            error, aborted = e.message, e.status_code == 503  # 503: the engine aborted (the rollout is stopping)
            logger.warning("coding agent session %s ended early: %s", session_id, error)
        finally:
            await client.close()
        candidate = await collect_candidate(sandbox, task)
    if aborted:  # an unfinished episode is not scored; the rollout treats the prompt as aborted
        adapter.drop_session(session_id, "the engine aborted the episode")
        sample.status = Sample.Status.ABORTED
        return [sample]
    score, graded = await grade(task, candidate)
    samples = await adapter.finish_session(
        session_id,
        base_sample=sample,
        reward=score,
        extra_metadata={
            "tool_log": tool_log,
            "tool_timeouts": sum(e["timed_out"] for e in tool_log),
            "tool_errors": sum(e["result"].startswith("error:") for e in tool_log),
            "grade": graded,
            "error": error,
        },
    )
    if not samples:
        raise RuntimeError(f"coding agent session {session_id} produced no turn: {error}")
    return samples
