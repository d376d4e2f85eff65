"""``make k8s-e2e``: a real job on a real cluster. Skipped unless KUBECONFIG and UNBROKEN_E2E_IMAGE are set."""


def pytest_configure(config):
    config.addinivalue_line("markers", "k8s_e2e: runs a real job on the cluster KUBECONFIG points to")
