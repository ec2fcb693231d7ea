"""How hard is Digits-M? Linear probe on raw pixels and on a randomly initialised trunk, plus kNN.

    uv run python benchmarks/calibrate_digits.py [--backbone resnet18] [--small-input]

Prints a Markdown table and the per-channel mean/std of the training split (the DataModule's
normalisation constants). The linear probe is a multinomial logistic regression (full-batch
L-BFGS, weight decay 1e-4) on standardised features; the kNN is the NPID weighted kNN (k=200, T=0.07) on L2-normalised features.
"""

import time

import numpy as np
import torch
import torch.nn.functional as F

from backbones import build_backbone
from datamodules.digits import DigitsDataModule, composite_digits
from engine.arguments import ScriptArgumentParser
from methods.evaluation import knn_predict, knn_topk_accuracy


def linear_probe_top1(train_x, train_y, test_x, test_y, weight_decay: float = 1e-4) -> float:
    """Multinomial logistic regression on standardised features, full-batch L-BFGS."""
    train_x, test_x = torch.as_tensor(train_x, dtype=torch.float32), torch.as_tensor(test_x, dtype=torch.float32)
    mean, std = train_x.mean(0), train_x.std(0) + 1e-6
    train_x, test_x = (train_x - mean) / std, (test_x - mean) / std
    train_y = torch.as_tensor(train_y)
    classifier = torch.nn.Linear(train_x.shape[1], 10)
    optimizer = torch.optim.LBFGS(classifier.parameters(), max_iter=300, history_size=20, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = F.cross_entropy(classifier(train_x), train_y) + weight_decay * classifier.weight.pow(2).sum()
        loss.backward()
        return loss

    optimizer.step(closure)
    with torch.no_grad():
        return float((classifier(test_x).argmax(1) == torch.as_tensor(test_y)).float().mean())


def knn_top1(train_x, train_y, test_x, test_y) -> float:
    bank = F.normalize(torch.as_tensor(train_x, dtype=torch.float32), dim=1)
    queries = F.normalize(torch.as_tensor(test_x, dtype=torch.float32), dim=1)
    scores = knn_predict(queries, bank, torch.as_tensor(train_y), 10)
    return float(knn_topk_accuracy(scores, torch.as_tensor(test_y), 1))


@torch.no_grad()
def trunk_features(trunk, images: np.ndarray) -> np.ndarray:
    mean = torch.tensor(DigitsDataModule.mean).view(1, 3, 1, 1)
    std = torch.tensor(DigitsDataModule.std).view(1, 3, 1, 1)
    batches = torch.from_numpy(images).permute(0, 3, 1, 2).float().div(255).sub(mean).div(std).split(512)
    return torch.cat([trunk(batch) for batch in batches]).numpy()


def main() -> None:
    parser = ScriptArgumentParser(description=__doc__)
    parser.add_argument("--backbone", default="resnet18")
    parser.add_argument("--small-input", action="store_true")
    parser.add_argument("--seeds", type=int, default=3, help="random initialisations of the trunk")
    args = parser.parse_args()

    start = time.time()
    (train_x, train_y), (val_x, val_y) = composite_digits("train", 4), composite_digits("val", 2)
    print(f"generated {len(train_y)} train / {len(val_y)} val images in {time.time() - start:.1f} s")
    pixels = train_x.reshape(len(train_x), -1) / 255
    print("train channel mean", np.round(pixels.reshape(-1, 32 * 32, 3).mean((0, 1)), 4))
    print("train channel std ", np.round(pixels.reshape(-1, 32 * 32, 3).std((0, 1)), 4))

    rows = [("raw pixels", linear_probe_top1(pixels, train_y, val_x.reshape(len(val_x), -1) / 255, val_y),
             knn_top1(pixels, train_y, val_x.reshape(len(val_x), -1) / 255, val_y))]
    for seed in range(args.seeds):
        torch.manual_seed(seed)
        trunk, _ = build_backbone(args.backbone, args.small_input)
        trunk.eval()
        train_f, val_f = trunk_features(trunk, train_x), trunk_features(trunk, val_x)
        rows.append((f"random {args.backbone} (seed {seed})", linear_probe_top1(train_f, train_y, val_f, val_y),
                     knn_top1(train_f, train_y, val_f, val_y)))
    print("\n| features | linear probe top-1 | kNN top-1 |\n|---|---|---|")
    for name, probe, knn in rows:
        print(f"| {name} | {100 * probe:.1f} | {100 * knn:.1f} |")


if __name__ == "__main__":
    main()
