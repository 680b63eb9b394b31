"""The model and data of tests/colossalai_style_train.py (a small image classifier, as ColossalAI's ResNet example
trains), which the test's plain PyTorch reference builds too."""

import torch
import torch.nn as nn
import torch.nn.functional as F

LEARNING_RATE = 1e-3


class Net(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = nn.Conv2d(3, 6, 3, padding=1)
        self.fc1 = nn.Linear(6 * 4 * 4, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc2(F.relu(self.fc1(torch.flatten(x, 1))))


def trainset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(7)
    images, labels = torch.randn(32, 3, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    return torch.utils.data.TensorDataset(images, labels)
