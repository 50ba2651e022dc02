"""The one-shot GPU check behind benchmarks/gpu_report.py (docs/gpu.md), one idea per module:

  orchestrate.py  runs each part in its own process under its own time limit, rewrites the report
  verdict.py      the exit status: what must be true for the check to pass (CUDA seen, every gpu test run)
  report.py       JUnit summary and the markdown report
  rows.py         how a part hands rows to the orchestrator; a part's deadline
  part_env.py     versions, GPU, imports            part_tests.py   `pytest -m gpu`
  part_train.py   training tokens/s and MFU         part_decode.py  decoding tokens/s and forwards/s
  predict.py      the dry run's step time for each train case, to set beside the measured one

The orchestrator, the verdict and the report use the standard library only: they run even where the
stack does not import. The parts import the stack.
"""
