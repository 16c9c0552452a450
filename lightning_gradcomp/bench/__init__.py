"""Benchmarks of the package: ``python -m lightning_gradcomp.bench {link,codecs,accuracy,tta,memory,plot}``.

- ``link``: DDP training steps over a real, shaped network (one Linux network namespace per host),
  every codec against plain all-reduce and the no-communication floor (:mod:`.link`, :mod:`.worker`).
- ``codecs``: encode + decode cost of each codec on real gradients, one process; codecs that learn
  from the gradients fitted first on real or random batches (``--fit-steps``) (:mod:`.codecs`).
- ``accuracy``: the recipes run with a fixed budget per codec and seed; task metric against bytes
  sent, and the validation history (:mod:`.accuracy`).
- ``tta``: time to accuracy on a slow link, the accuracy runs' steps to a target times the link
  runs' step time (:mod:`.tta`).
- ``memory``: RSS and peak RSS of each rank early and late in a long compressed run (:mod:`.memory`).
- ``plot``: figures and the tables of ``docs/benchmarks.md`` from the JSON results (:mod:`.plot`).

Each verb writes JSON and CSV to ``docs/results/<verb>`` of the checkout it runs from, to
``$LIGHTNING_GRADCOMP_RESULTS/<verb>`` when that is set, else under ``~/.cache`` (:mod:`.paths`).
"""
