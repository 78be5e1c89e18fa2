"""A stand-in for JAX's distributed client: what `jckpt.api.runtime.Runtime` asks of it."""

import json


class FakeClient:
    """What Runtime asks of JAX's distributed client: a key-value store and barriers, one
    process's view; `blocked` barriers (or meetings, by the prefix of the keys they gather)
    time out as a missing peer makes them, and `peers` says what the other processes put
    before a barrier (keys under the barrier's tag). At a meeting (`Runtime.gather`), a peer
    not in `peers` says what this process said, without failure."""

    def __init__(self, blocked=(), peers=None, late=0):
        self.kv, self.blocked, self.met, self.peers = {}, set(blocked), [], peers or {}
        self.names = []  # every barrier's (or meeting's) full name
        self.waits = 0  # blocking gets that timed out
        self.late = late  # blocking gets that time out before the peers come (slow peers)

    def key_value_set(self, key, value, allow_overwrite=False):
        assert allow_overwrite or key not in self.kv, key
        self.kv[key] = value

    def key_value_dir_get(self, prefix):
        return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]

    def wait_at_barrier(self, name, timeout_ms):
        tag, _, last = name.rpartition("/")
        self.met.append(last)
        self.names.append(name)
        for key, value in self.peers.items():
            self.kv[f"{tag}/{key}"] = value
        if last in self.blocked:
            raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out. # of tasks that reached the "
                               "barrier: 1/2")

    def key_value_try_get(self, key):
        return self.kv[key]

    def blocking_key_value_get(self, key, timeout_ms):
        meeting = key.rsplit("/", 1)[0]  # `{tag}/said` (`agree`), `{tag}/at/written` (a barrier)
        tag, _, name = meeting.rpartition("/")
        tag = tag.removesuffix("/at")
        if self.late > 0:
            self.late -= 1
        elif key not in self.kv and meeting not in self.names:  # the peers come
            self.met.append(name)
            self.names.append(meeting)
            if name not in self.blocked:
                for k, value in self.peers.items():
                    self.kv[f"{tag}/{k}"] = value
        if key not in self.kv and name not in self.blocked and meeting in self.names:
            mine = next(v for k, v in self.kv.items() if k.startswith(f"{meeting}/"))
            self.kv[key] = mine and json.dumps({**json.loads(mine), "type": None, "message": None,
                                                "fix": None})
        if key not in self.kv:
            self.waits += 1
            raise RuntimeError("DEADLINE_EXCEEDED: Deadline Exceeded")
        return self.kv[key]
