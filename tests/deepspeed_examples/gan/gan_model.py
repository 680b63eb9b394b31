"""DCGAN generator and discriminator for 64x64 images, as DeepSpeedExamples' training/gan builds them."""

import torch.nn as nn


def weights_init(m):
    classname = m.__class__.__name__
    if classname.find("Conv") != -1:
        nn.init.normal_(m.weight.data, 0.0, 0.02)
    elif classname.find("BatchNorm") != -1:
        nn.init.normal_(m.weight.data, 1.0, 0.02)
        nn.init.constant_(m.bias.data, 0)


def _up(cin, cout, stride, padding):
    return [nn.ConvTranspose2d(cin, cout, 4, stride, padding, bias=False), nn.BatchNorm2d(cout), nn.ReLU(True)]


def _down(cin, cout, norm=True):
    layers = [nn.Conv2d(cin, cout, 4, 2, 1, bias=False)]
    return layers + ([nn.BatchNorm2d(cout)] if norm else []) + [nn.LeakyReLU(0.2, inplace=True)]


class Generator(nn.Module):
    def __init__(self, ngpu, ngf, nc, nz):
        super().__init__()
        self.ngpu = ngpu
        # nz -> (ngf*8) x 4 x 4 -> 8 x 8 -> 16 x 16 -> 32 x 32 -> nc x 64 x 64
        self.main = nn.Sequential(*_up(nz, ngf * 8, 1, 0), *_up(ngf * 8, ngf * 4, 2, 1), *_up(ngf * 4, ngf * 2, 2, 1),
                                  *_up(ngf * 2, ngf, 2, 1), nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())

    def forward(self, input):
        return self.main(input)


class Discriminator(nn.Module):
    def __init__(self, ngpu, ndf, nc):
        super().__init__()
        self.ngpu = ngpu
        # nc x 64 x 64 -> ndf x 32 x 32 -> 16 x 16 -> 8 x 8 -> (ndf*8) x 4 x 4 -> 1
        self.main = nn.Sequential(*_down(nc, ndf, norm=False), *_down(ndf, ndf * 2), *_down(ndf * 2, ndf * 4),
                                  *_down(ndf * 4, ndf * 8), nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid())

    def forward(self, input):
        return self.main(input).view(-1, 1).squeeze(1)
