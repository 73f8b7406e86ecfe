"""Torch helpers that the engine (:mod:`launcher.runtime`), the models (:mod:`launcher.models`),
the cutter (:mod:`launcher.split`) and the Lightning strategies all use; none of them runs a step.

- :mod:`.staged`: staged models (a list of stage modules and a loss), how a stage is called;
  :mod:`.values`: what stages pass each other; :mod:`.signatures`: what each stage returns;
  :mod:`.stage_errors` and :mod:`.checks`: one sentence per problem that stops a model from being
  staged or trained, and the built-in models' argument checks;
- :mod:`.init`: models built on the meta device and materialised where they are owned;
- :mod:`.streams`: random draws that belong to the job, not to the worker; :mod:`.rng`: the user's
  random state kept through what the launcher runs before training;
- :mod:`.post_validation`: a stage's provisional optimizer step and its in-place rollback;
- :mod:`.torch_private`: every private name of torch the launcher relies on, in one place.

At the layer of :mod:`launcher.runtime`, below it: it imports :mod:`launcher.schedule` only.
"""
