import os

print('OMP', os.environ.get('OMP_NUM_THREADS'))
