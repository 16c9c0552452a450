"""Benchmarks of the package: ``python -m lightning_gradcomp.bench {link,codecs,accuracy,tta,plot}``.

- ``link``: DDP training steps over a real, shaped network (one Linux network namespace per host),
  every codec against plain all-reduce and the no-communication floor (:mod:`.link`, :mod:`.worker`).
- ``codecs``: encode + decode cost of each codec on real gradients, one process (:mod:`.codecs`).
- ``accuracy``: the recipes run with a fixed budget per codec and seed; task metric against bytes
  sent, and the validation history (:mod:`.accuracy`).
- ``tta``: time to accuracy on a slow link, the accuracy runs' steps to a target times the link
  runs' step time (:mod:`.tta`).
- ``plot``: figures and the tables of ``docs/benchmarks.md`` from the JSON results (:mod:`.plot`).
"""
