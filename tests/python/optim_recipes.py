"""Training recipes as users write them: a torch.optim optimizer over two
param groups (their own rates and weight decay), a scheduler, and gradient
clipping, built the same way by a pstrain worker and by the one-process
reference it must match."""

import torch

STEPS = 30


def warmup_cosine(optimizer, steps=STEPS, warmup=5):
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [
        torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1,
                                          total_iters=warmup),
        torch.optim.lr_scheduler.CosineAnnealingLR(optimizer,
                                                   T_max=steps - warmup)],
        milestones=[warmup])


def groups(model, lr):
    """Two groups: the first layer at `lr`, the rest at half of it, with
    weight decays of their own."""
    first = list(model[0].parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    return [{"params": first, "weight_decay": 1e-3},
            {"params": rest, "lr": lr / 2, "weight_decay": 1e-2}]


def build(recipe, model, steps=STEPS):
    """(optimizer, scheduler or None, max_norm for clip_grad_norm_ or None)"""
    g = groups
    if recipe == "sgd_momentum":
        opt = torch.optim.SGD(g(model, 0.1), lr=0.1, momentum=0.9,
                              dampening=0.1)
        return opt, warmup_cosine(opt, steps), None
    if recipe == "sgd_nesterov":
        opt = torch.optim.SGD(g(model, 0.1), lr=0.1, momentum=0.8,
                              nesterov=True)
        return opt, torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=[0.2, 0.1], total_steps=steps), None
    if recipe == "adam":
        opt = torch.optim.Adam(g(model, 0.01), lr=0.01)
        # Cycles betas[0] too (cycle_momentum's default).
        return opt, torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=0.02, total_steps=steps), None
    if recipe == "adamw":
        opt = torch.optim.AdamW(g(model, 0.01), lr=0.01, betas=(0.8, 0.99))
        return opt, warmup_cosine(opt, steps), None
    if recipe == "adagrad":
        opt = torch.optim.Adagrad(g(model, 0.05), lr=0.05, lr_decay=0.01,
                                  initial_accumulator_value=0.1)
        return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=10,
                                                    gamma=0.5), None
    if recipe == "rmsprop":
        opt = torch.optim.RMSprop(g(model, 0.005), lr=0.005, alpha=0.9,
                                  momentum=0.5, centered=True)
        return opt, warmup_cosine(opt, steps), None
    if recipe == "adam_clipped":
        opt = torch.optim.Adam(g(model, 0.01), lr=0.01)
        return opt, warmup_cosine(opt, steps), 0.5
    if recipe == "sgd_constant":  # no scheduler: the registered rates
        return torch.optim.SGD(g(model, 0.1), lr=0.1), None, None
    if recipe == "sgd_decay":  # one group, lr 0.1 / (1 + step)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        return opt, torch.optim.lr_scheduler.LambdaLR(
            opt, lambda step: 1 / (1 + step)), None
    raise ValueError(recipe)


RECIPES = ["sgd_momentum", "sgd_nesterov", "adam", "adamw", "adagrad",
           "rmsprop", "adam_clipped"]
