"""The two training loops behind one ``Loop`` protocol (``base``): sync mode (``sync``, the hybrid
engine) and async mode (``async_loop``, with its generator actors in ``pool``). ``common`` holds
what both share: the learner step with its metrics, and DAPO dynamic sampling."""
