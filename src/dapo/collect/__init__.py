"""Collecting a step's batch: ``base`` (the one interface the loop calls, ``Collector.take(step) -> StepBatch``),
``collector`` (in process, or ahead of the trainer: chosen once), ``dynamic_sampling`` (rounds of generation,
grading and the filter until P informative groups), ``screening`` (n responses first, the rest only where they
disagree), ``ahead`` (the collection in a thread, its engine in a rollout process or on rollout ranks),
``scoring`` (rule reward and overlong shaping) and ``stats`` (what a collection counted, and its metrics)."""
