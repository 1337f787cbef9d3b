import ray

from slime.utils.http_utils import free_port


class RayActor:
    """Mixin for actors: the node IP and free consecutive ports on that node."""

    @staticmethod
    def _node_ip() -> str:
        return ray._private.services.get_node_ip_address().strip("[]")

    @staticmethod
    def _get_current_node_ip_and_free_port(start_port=None, consecutive=1):
        """(node IP, first of `consecutive` free ports). The OS picks them, outside Ray's worker ports; `start_port`
        is kept for callers of the old scan-from-a-number API and ignored (a fixed start made concurrent runs on one
        machine pick the same ports)."""
        return RayActor._node_ip(), free_port(consecutive)

    def get_master_addr_and_port(self):
        return self.master_addr, self.master_port
