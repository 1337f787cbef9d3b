import socket

import ray


class RayActor:
    """Mixin for actors: the node IP and free consecutive ports on that node."""

    @staticmethod
    def _get_current_node_ip_and_free_port(start_port=10000, consecutive=1):
        address = ray._private.services.get_node_ip_address().strip("[]")
        port = start_port
        while not all(_bindable(p) for p in range(port, port + consecutive)):
            port += 1
        return address, port

    def get_master_addr_and_port(self):
        return self.master_addr, self.master_port


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
            return True
        except OSError:
            return False
