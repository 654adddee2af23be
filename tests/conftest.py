import pytest


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords:
            try:
                import torch

                if torch.cuda.is_available():
                    continue
            except ImportError:
                pass
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
