"""DeepSpeedExamples' training/gan/gan_deepspeed_train.py in its own shape: the same calls in the same order, its
imports unchanged (`import deepspeed`), the CUDA device lines on the CPU (tests/deepspeed_examples/README.md).

    tiers launch --as-deepspeed --num_gpus 2 gan_deepspeed_train.py --dataset fake --workers 0 \\
        --deepspeed --deepspeed_config gan_deepspeed_config.json
"""

from time import time

import deepspeed
import torch
import torch.nn as nn
import torch.utils.data
from gan_model import Discriminator, Generator, weights_init
from utils import FakeData, create_folder, get_argument_parser, set_seed


def get_dataset(args):
    if str(args.dataset).lower() != "fake":
        raise ValueError("only --dataset fake is here (the others need torchvision and files)")
    dataset = FakeData(size=args.fake_size, image_size=(3, args.imageSize, args.imageSize))
    nc = 3
    return dataset, nc


def train(args):
    create_folder(args.outf)
    set_seed(args.manualSeed)
    dataset, nc = get_dataset(args)
    dataloader = torch.utils.data.DataLoader(dataset, batch_size=args.batchSize, shuffle=True,
                                             num_workers=int(args.workers))
    device = torch.device("cpu")  # was: torch.cuda.set_device(args.local_rank); torch.device("cuda", local_rank)
    ngpu = 0
    nz = int(args.nz)
    ngf = int(args.ngf)
    ndf = int(args.ndf)

    netG = Generator(ngpu, ngf, nc, nz).to(device)
    netG.apply(weights_init)
    if args.netG != "":
        netG.load_state_dict(torch.load(args.netG))

    netD = Discriminator(ngpu, ndf, nc).to(device)
    netD.apply(weights_init)
    if args.netD != "":
        netD.load_state_dict(torch.load(args.netD))

    criterion = nn.BCELoss()

    fixed_noise = torch.randn(args.batchSize, nz, 1, 1, device=device)  # noqa: F841 (the image dumps used it)
    real_label = 1
    fake_label = 0

    # setup optimizer
    optimizerD = torch.optim.Adam(netD.parameters(), lr=args.lr, betas=(args.beta1, 0.999))
    optimizerG = torch.optim.Adam(netG.parameters(), lr=args.lr, betas=(args.beta1, 0.999))

    model_engineD, optimizerD, _, _ = deepspeed.initialize(args=args, model=netD, model_parameters=netD.parameters(),
                                                           optimizer=optimizerD)
    model_engineG, optimizerG, _, _ = deepspeed.initialize(args=args, model=netG, model_parameters=netG.parameters(),
                                                           optimizer=optimizerG)

    losses = []
    start = time()  # was preceded by torch.cuda.synchronize()
    for epoch in range(args.epochs):
        for i, data in enumerate(dataloader, 0):
            # (1) Update D network: maximize log(D(x)) + log(1 - D(G(z)))
            # train with real
            netD.zero_grad()
            real = data[0].to(device)
            batch_size = real.size(0)
            label = torch.full((batch_size,), real_label, dtype=real.dtype, device=device)
            output = netD(real)
            errD_real = criterion(output, label)
            model_engineD.backward(errD_real)
            D_x = output.mean().item()

            # train with fake
            noise = torch.randn(batch_size, nz, 1, 1, device=device)
            fake = netG(noise)
            label.fill_(fake_label)
            output = netD(fake.detach())
            errD_fake = criterion(output, label)
            model_engineD.backward(errD_fake)
            D_G_z1 = output.mean().item()
            errD = errD_real + errD_fake
            model_engineD.step()

            # (2) Update G network: maximize log(D(G(z)))
            netG.zero_grad()
            label.fill_(real_label)  # fake labels are real for generator cost
            output = netD(fake)
            errG = criterion(output, label)
            model_engineG.backward(errG)
            D_G_z2 = output.mean().item()
            model_engineG.step()

            print("[%d/%d][%d/%d] Loss_D: %.4f Loss_G: %.4f D(x): %.4f D(G(z)): %.4f / %.4f"
                  % (epoch, args.epochs, i, len(dataloader), errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
            losses.append((errD.item(), errG.item(), D_x, D_G_z1, D_G_z2))
    stop = time()  # was preceded by torch.cuda.synchronize()
    print(f"total wall clock time for {args.epochs} epochs is {stop-start} secs")
    if args.losses_out:
        torch.save(losses, f"{args.losses_out}.rank{model_engineD.global_rank}")


def main():
    parser = get_argument_parser()
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()
    train(args)


if __name__ == "__main__":
    main()
