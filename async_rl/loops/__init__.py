"""The two training loops behind one ``Loop`` protocol (``base``): sync mode (``sync``, the hybrid
engine) and async mode (``async_loop``), which wires three components that do not know it:
``dispatch`` (admission, the broker feed, the re-issue queue), ``intake`` (the receiver thread's
routing and refusals) and ``pool`` (the generator actors' placement, supervision and weight
pushes), with the Ray-side actor classes in ``actors``. ``common`` holds what both loops share: the
learner step with its metrics, and DAPO dynamic sampling."""
