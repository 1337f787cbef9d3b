"""`python -m slime.backends.cpu_server --model-path DIR --host 127.0.0.1 --port P ...` (flag names as SGLang's)."""

import argparse
import json
import logging
import sys

from slime.utils.output_parsing import TOOL_CALL_FORMATS
from slime.utils.reasoning_parser import PARSERS
from slime.utils.top_p_replay import SGLANG_SAMPLING_MASK_MAX_TOKENS


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m slime.backends.cpu_server", description=__doc__)
    p.add_argument("--model-path", required=True, help="local HuggingFace model directory")
    p.add_argument("--tokenizer-path", default=None, help="defaults to --model-path")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--random-seed", type=int, default=0, help="seed of the sampler for requests without sampling_seed")
    p.add_argument("--max-running-requests", type=int, default=128, help="requests decoded together at most")
    p.add_argument(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV-cache size in tokens (default: max-running-requests x context, capped at 1 GiB of cache)",
    )
    p.add_argument("--max-prefill-tokens", type=int, default=16384, help="token budget of one prefill batch")
    p.add_argument("--context-length", type=int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument(
        "--weight-version", default="default", help="initial weight version (as SGLang's; slime starts engines at 0)"
    )
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's dtype), float32, bfloat16 or float16")
    p.add_argument(
        "--num-threads", type=int, default=1, help="torch threads (the server is single-threaded by default)"
    )
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="as SGLang's: a request's results do not depend on the batch it runs in (each runs its own forward)",
    )
    p.add_argument(
        "--disable-radix-cache",
        action="store_true",
        help="as SGLang's: no prefix cache and no prefix sharing (by default computed rows are kept for later "
        "requests that start the same way, and one prefill serves live requests with identical prompts)",
    )
    p.add_argument(
        "--radix-eviction-policy",
        default="lru",
        help="as SGLang's: which cached rows go first when the KV pool runs dry: lru, lfu or slru (SGLang's "
        "priority and tlru are not implemented here)",
    )
    p.add_argument(
        "--radix-eviction-policy-config",
        type=json.loads,
        default=None,
        help="as SGLang's: the policy's parameters as a JSON object (slru: {\"protected_threshold\": 2})",
    )
    p.add_argument(
        "--sampling-mask-max-tokens",
        type=int,
        default=SGLANG_SAMPLING_MASK_MAX_TOKENS,
        help="as SGLang's: return_sampling_mask needs top_k=1 or 1 < top_k <= this (token ids per returned mask)",
    )
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", default="info")
    p.add_argument(
        "--api-key", default=None, help="as SGLang's: required (Bearer) on every endpoint but health probes"
    )
    p.add_argument(
        "--admin-api-key", default=None, help="as SGLang's: required on admin endpoints instead of --api-key"
    )
    p.add_argument(
        "--sampling-defaults",
        choices=["openai", "model"],
        default="model",
        help="as SGLang's: where /v1/chat/completions takes the sampling parameters a request leaves out: the "
        "model's generation_config.json (model), else OpenAI's defaults",
    )
    p.add_argument(
        "--tool-call-parser",
        choices=sorted(TOOL_CALL_FORMATS),
        default=None,
        help="as SGLang's: a chat with tools answers the calls in the output as message.tool_calls (streamed: "
        "as delta.tool_calls pieces)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=PARSERS,
        default=None,
        help="as SGLang's: a chat's output split into message.reasoning_content and content (streamed: "
        "delta.reasoning_content), its thinking tokens counted in usage.reasoning_tokens",
    )
    p.add_argument(
        "--enable-cache-report",
        action="store_true",
        help="as SGLang's: OpenAI answers report the prompt tokens taken from the prefix cache (usage."
        "prompt_tokens_details.cached_tokens)",
    )
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="as SGLang's: requests may ask for each token's routed MoE experts (return_routed_experts)",
    )
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        help="as SGLang's: the only hosts http(s) image URLs may name (redirects included); unset: any host",
    )
    p.add_argument(
        "--media-url-max-file-size-mb",
        type=int,
        default=64,
        help="as SGLang's: the largest image download in MiB (0: no limit); REQUEST_TIMEOUT (s, default 3) bounds it",
    )
    # LoRA serving, as SGLang's flags
    p.add_argument("--enable-lora", action="store_true", default=None, help="serve LoRA adapters")
    p.add_argument("--max-lora-rank", type=int, default=None, help="the largest adapter rank accepted")
    p.add_argument("--lora-target-modules", nargs="*", default=None, help="projections adapters may target, or all")
    p.add_argument("--lora-paths", nargs="*", default=None, help="adapters loaded at start: PATH | NAME=PATH | JSON")
    p.add_argument("--max-loras-per-batch", type=int, default=8, help="adapters in a running batch, base included")
    p.add_argument("--max-loaded-loras", type=int, default=None, help="adapters held at most (LRU unloaded)")
    return p


def main(argv=None):
    parser = build_parser()
    args = parser.parse_args(argv)
    from slime.utils.media_download import configure_media_urls

    from .radix_cache import eviction_order

    try:
        configure_media_urls(args.allowed_media_domains, args.media_url_max_file_size_mb)
        eviction_order(args.radix_eviction_policy, args.radix_eviction_policy_config)  # checked before loading
    except ValueError as e:
        parser.error(str(e))
    logging.basicConfig(
        level=args.log_level.upper(), stream=sys.stderr, format="[%(asctime)s cpu_server] %(levelname)s %(message)s"
    )
    from .model import UnsupportedModelError  # heavy: after the argument checks
    from .server import run_server  # heavy: after the argument checks
    from .weights import WeightError  # heavy: after the argument checks

    try:
        run_server(args)
    except (UnsupportedModelError, WeightError, OSError) as e:
        # a user mistake (bad model dir, busy port): one clear line, no traceback
        logging.getLogger("slime.cpu_server").error("cannot start: %s", e)
        sys.exit(1)


if __name__ == "__main__":
    main()
