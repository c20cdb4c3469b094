"""The algorithm: what a response is worth (``advantages``), the objectives (``losses``), the correction for the
weights and kernels that sampled (``rollout_correction``), and what a step computes on its batch before the update
(``step``); ``batch`` is the typed record they work on. ``advantages``, ``losses`` and ``rollout_correction`` are pure
tensor functions, each checkable by hand against its paper.

Batch conventions used everywhere in the project:
  P prompts, G samples each (``group_size``), N = P * G rows in prompt-major order, so rows
  i*G .. i*G+G-1 share prompt i and a group is ``x.view(P, G)``. T is the response-token axis;
  ``response_mask`` (N, T) is 1 where a token is trained on (0 on padding, and on whole rows
  removed by overlong filtering).
"""
