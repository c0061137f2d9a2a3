"""A small PyTorch classifier served by vramguard: 8 numbers in, 3 class probabilities out."""

import numpy as np
import torch

from vramguard import InvalidInputError

N_FEATURES, N_CLASSES = 8, 3


class TinyClassifier:
    """example: 8 numbers in, probabilities of 3 classes out.

    Follows vramguard.ModelBackend; every method but __init__ runs on the worker's model thread. The
    class attributes below describe it to `vramguard up --backend tiny_classifier.serving:TinyClassifier`
    (models.toml says the same for VRAMGUARD_MODELS_FILE).
    """

    name = "tiny"
    input_kind = "json"
    output = {"kind": "tensor", "datatype": "float32", "shape": [N_CLASSES]}
    example = [[0.5, -1.0, 2.0, 0.0, 1.5, -0.5, 0.25, 3.0]]  # one request's inputs: 8 numbers
    max_item_cost = 1  # every item is the same size: the memory planner measures per item

    def __init__(self, config, device, settings):
        self.device = device
        self.net = None

    def load(self):
        torch.manual_seed(0)  # fixed weights: a real model would load a checkpoint here
        self.net = torch.nn.Sequential(torch.nn.Linear(N_FEATURES, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, N_CLASSES)).to(self.device).eval()

    def decode(self, inputs, parameters):  # one request -> one float32[8] tensor per input
        items = []
        for i, value in enumerate(inputs):
            if not isinstance(value, list) or len(value) != N_FEATURES:
                raise InvalidInputError(f"inputs[{i}]: expected a list of {N_FEATURES} numbers")
            try:
                items.append(torch.tensor(value, dtype=torch.float32))
            except (TypeError, ValueError) as exc:
                raise InvalidInputError(f"inputs[{i}]: {exc}") from None
        return items

    def item_cost(self, item):
        return 1

    def sample_item(self, cost):
        return torch.zeros(N_FEATURES)

    def collate(self, items):  # -> float32[n, 8] on the device
        return torch.stack(items).to(self.device)

    def forward(self, batch):  # -> float32[n, 3] on the CPU
        with torch.inference_mode():
            return self.net(batch).softmax(dim=1).cpu().numpy()

    def split(self, outputs, n_items):
        return list(outputs)

    def encode(self, item, output):
        return output.astype(np.float32)

    def example_inputs(self):
        return [[0.0] * N_FEATURES, [1.0] * N_FEATURES]
