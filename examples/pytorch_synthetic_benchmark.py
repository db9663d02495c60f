# Horovod's synthetic-data training benchmark for PyTorch, on horovod_torch.
# Adapted from
# https://github.com/horovod/horovod/blob/master/examples/pytorch/pytorch_synthetic_benchmark.py
#
#   horovodrun -np 2 python examples/pytorch_synthetic_benchmark.py            # GPUs, resnet50
#   horovodrun -np 2 python examples/pytorch_synthetic_benchmark.py --no-cuda \
#       --model resnet18 --batch-size 4 --num-iters 2 --num-batches-per-iter 2 \
#       --num-warmup-batches 1                                                   # quick, on CPU
#
# Every worker trains the model on one fixed random batch; the speed printed is
# images per second of one worker (mean of --num-iters measurements, +- 1.96 standard
# deviations) and that times the number of workers.
import argparse
import os
import timeit

import numpy as np
import torch
import torch.backends.cudnn as cudnn
import torch.nn.functional as F
import torch.optim as optim
from torchvision import models

import horovod.torch as hvd

# Benchmark settings
parser = argparse.ArgumentParser(description='PyTorch Synthetic Benchmark',
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument('--fp16-allreduce', action='store_true', default=False,
                    help='use fp16 compression during allreduce')

parser.add_argument('--model', type=str, default='resnet50',
                    help='model to benchmark (any torchvision.models classification model)')
parser.add_argument('--batch-size', type=int, default=32,
                    help='input batch size (per backward pass)')
parser.add_argument('--image-size', type=int, default=None,
                    help='input height and width (default: 299 for inception_v3, else 224)')
parser.add_argument('--num-classes', type=int, default=1000,
                    help='number of output classes')

parser.add_argument('--num-warmup-batches', type=int, default=10,
                    help='number of warm-up batches that don\'t count towards benchmark')
parser.add_argument('--num-batches-per-iter', type=int, default=10,
                    help='number of batches per benchmark iteration')
parser.add_argument('--num-iters', type=int, default=10,
                    help='number of benchmark iterations')
parser.add_argument('--batches-per-allreduce', type=int, default=1,
                    help='number of batches processed locally before executing allreduce '
                         'across workers (backward_passes_per_step); it multiplies the '
                         'images of one benchmark batch')

parser.add_argument('--no-cuda', action='store_true', default=False,
                    help='disables CUDA training')

parser.add_argument('--use-adasum', action='store_true', default=False,
                    help='use adasum algorithm to do reduction')


def classification_models():
    return sorted(name for name in models.list_models(module=models))


def main():
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()
    if args.model not in classification_models():
        parser.error('unknown --model %r; choose one of: %s'
                     % (args.model, ', '.join(classification_models())))
    if args.batches_per_allreduce < 1:
        parser.error('--batches-per-allreduce must be >= 1')

    hvd.init()

    if args.cuda:
        # Horovod: pin GPU to local rank.
        torch.cuda.set_device(hvd.local_rank())
        cudnn.benchmark = True
    else:
        # Horovod: share the CPU cores of a host between its workers.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))

    # Set up standard model.
    kwargs = {'num_classes': args.num_classes}
    if args.model in ('googlenet', 'inception_v3'):
        kwargs['init_weights'] = True  # their default; passing it silences a FutureWarning
    model = models.get_model(args.model, **kwargs)
    image_size = args.image_size or (299 if args.model == 'inception_v3' else 224)

    # By default, Adasum doesn't need scaling up learning rate.
    lr_scaler = hvd.size() if not args.use_adasum else 1

    if args.cuda:
        # Move model to GPU.
        model.cuda()
        # If using GPU Adasum allreduce, scale learning rate by local_size.
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    optimizer = optim.SGD(model.parameters(), lr=0.01 * lr_scaler)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap optimizer with DistributedOptimizer.
    # (op=hvd.Adasum raises ValueError in this build: Adasum is not implemented yet.)
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         backward_passes_per_step=args.batches_per_allreduce,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)

    # Horovod: broadcast parameters & optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Set up fixed fake data
    data = torch.randn(args.batch_size, 3, image_size, image_size)
    target = torch.LongTensor(args.batch_size).random_() % args.num_classes
    if args.cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step():
        optimizer.zero_grad()
        for _ in range(args.batches_per_allreduce):
            output = model(data)
            if not isinstance(output, torch.Tensor):  # e.g. inception_v3/googlenet aux outputs
                output = output[0]
            loss = F.cross_entropy(output, target)
            if args.batches_per_allreduce > 1:
                loss = loss / args.batches_per_allreduce
            loss.backward()
        optimizer.step()
        if args.cuda:
            torch.cuda.synchronize()

    def log(s, nl=True):
        if hvd.rank() != 0:
            return
        print(s, end='\n' if nl else '', flush=True)

    device = 'GPU' if args.cuda else 'CPU'
    images_per_batch = args.batch_size * args.batches_per_allreduce
    log('Model: %s' % args.model)
    log('Batch size: %d' % args.batch_size)
    if args.batches_per_allreduce > 1:
        log('Batches per allreduce: %d (%d images per step)'
            % (args.batches_per_allreduce, images_per_batch))
    log('Number of %ss: %d' % (device, hvd.size()))
    if not args.cuda:
        log('Threads per worker: %d' % torch.get_num_threads())

    # Warm-up
    log('Running warmup...')
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)

    # Benchmark
    log('Running benchmark...')
    img_secs = []
    for x in range(args.num_iters):
        time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = images_per_batch * args.num_batches_per_iter / time
        log('Iter #%d: %.1f img/sec per %s' % (x, img_sec, device))
        img_secs.append(img_sec)

    # Results
    img_sec_mean = np.mean(img_secs)
    img_sec_conf = 1.96 * np.std(img_secs)
    log('Img/sec per %s: %.1f +-%.1f' % (device, img_sec_mean, img_sec_conf))
    log('Total img/sec on %d %s(s): %.1f +-%.1f' %
        (hvd.size(), device, hvd.size() * img_sec_mean, hvd.size() * img_sec_conf))


if __name__ == '__main__':
    main()
