class Box:
    """Wraps an ObjectRef so Ray does not dereference it when it is passed as an actor-call argument."""

    def __init__(self, inner):
        self._inner = inner

    @property
    def inner(self):
        return self._inner
