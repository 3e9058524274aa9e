import argparse
import os

import torch
from torch.utils.checkpoint import checkpoint

import zero3 as deepspeed
from zero3.accelerator import get_accelerator


class Adapter(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.base = torch.nn.Linear(8, 8, bias=False)
        self.base.weight.requires_grad_(False)
        self.adapter_A = torch.nn.Linear(8, 2, bias=False)
        self.adapter_B = torch.nn.Linear(2, 8, bias=False)

    def forward(self, value):
        base = self.base(value)
        value = value.to(self.adapter_A.weight.dtype)
        return base + self.adapter_B(self.adapter_A(value))


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.adapter = Adapter()

    def forward(self, value):
        return checkpoint(self.adapter, value, use_reentrant=True).square().mean()


def initialize():
    model = Model()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    config = {
        'train_micro_batch_size_per_gpu': 2,
        'gradient_accumulation_steps': 4,
        'zero_optimization': {
            'stage': 3,
            'stage3_param_persistence_threshold': 16,
            'stage3_prefetch_bucket_size': 0,
            'stage3_max_reuse_distance': 0,
            'offload_param': {'device': 'cpu', 'pin_memory': False},
        },
    }
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
    return engine


def train_step(engine):
    for _ in range(4):
        value = torch.ones(2, 8, device=engine.device, requires_grad=True)
        loss = engine(value)
        engine.backward(loss)
        engine.step()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('checkpoint_directory')
    args = parser.parse_args()
    get_accelerator().set_device(int(os.environ['LOCAL_RANK']))
    deepspeed.init_distributed(dist_backend=get_accelerator().communication_backend_name())
    torch.manual_seed(42)
    engine = initialize()
    train_step(engine)
    engine.save_checkpoint(args.checkpoint_directory, tag='seed')
    engine.destroy()
    engine = initialize()
    loaded, _ = engine.load_checkpoint(args.checkpoint_directory, tag='seed')
    assert loaded is not None and engine.global_steps == 1
    train_step(engine)
    assert engine.global_steps == 2
    engine.destroy()
    print('FULL_RESUME_PASS', flush=True)


if __name__ == '__main__':
    main()
