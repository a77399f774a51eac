"""lm-evaluation-harness's own command line with the zoo backend registered (lm-eval finds model classes by
import, not by entry point):

    python -m cli.lm_eval_cli run --model zoo --model_args pretrained=./model --tasks hellaswag --batch_size 16
"""

from __future__ import annotations

import serving.lm_eval_model  # noqa: F401 - registers the "zoo" model class


def main() -> None:
    """Run ``lm_eval``'s CLI on ``sys.argv``."""
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
