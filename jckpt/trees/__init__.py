"""Trees and placement: pytrees to flat entries and back, arrays between host and devices.

`pytree` turns a pytree into `(key path, leaf)` pairs and back; `to_host` is
the one path from a leaf to host memory, `placement` the one from host memory onto devices;
`sharding` does the box arithmetic of shards and reads only what each device needs.
"""
