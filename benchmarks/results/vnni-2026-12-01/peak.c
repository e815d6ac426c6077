// Clock (dependent adds, 1 cycle each) and VPDPBUSD throughput (zmm and ymm, 12 independent chains).
#include <stdio.h>
#include <time.h>
static double now(void){struct timespec t; clock_gettime(CLOCK_MONOTONIC,&t); return t.tv_sec+t.tv_nsec*1e-9;}
#define R10(x) x x x x x x x x x x
static double clock_ghz(long iters){
  long v=0; double t0=now();
  for(long i=0;i<iters;i++){ __asm__ volatile(R10(R10("add $1, %0\n\t")) : "+r"(v)); }
  double t=now()-t0; return iters*100.0/t/1e9;
}
#define Z12(op,r) op " %%" r "29, %%" r "30, %%" r "0\n\t" op " %%" r "29, %%" r "30, %%" r "1\n\t" op " %%" r "29, %%" r "30, %%" r "2\n\t" op " %%" r "29, %%" r "30, %%" r "3\n\t" \
  op " %%" r "29, %%" r "30, %%" r "4\n\t" op " %%" r "29, %%" r "30, %%" r "5\n\t" op " %%" r "29, %%" r "30, %%" r "6\n\t" op " %%" r "29, %%" r "30, %%" r "7\n\t" \
  op " %%" r "29, %%" r "30, %%" r "8\n\t" op " %%" r "29, %%" r "30, %%" r "9\n\t" op " %%" r "29, %%" r "30, %%" r "10\n\t" op " %%" r "29, %%" r "30, %%" r "11\n\t"
static double dp_rate(long iters, int zmm){ // instructions per ns
  double t0=now();
  if(zmm) for(long i=0;i<iters;i++){ __asm__ volatile(Z12("vpdpbusd","zmm") Z12("vpdpbusd","zmm") ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11"); }
  else for(long i=0;i<iters;i++){ __asm__ volatile(Z12("vpdpbusd","ymm") Z12("vpdpbusd","ymm") ::: "xmm0","xmm1","xmm2","xmm3","xmm4","xmm5","xmm6","xmm7","xmm8","xmm9","xmm10","xmm11"); }
  double t=now()-t0; return iters*24.0/t/1e9;
}
int main(){
  double ghz=0, z=0, y=0;
  for(int r=0;r<3000;r++){ double g=clock_ghz(20000), a=dp_rate(20000,1), b=dp_rate(20000,0);
    if(g>ghz)ghz=g; if(a>z)z=a; if(b>y)y=b; }
  printf("clock %.2f GHz (best of 3000 short runs, dependent adds); vpdpbusd zmm %.2f/ns = %.2f/cycle = %.0f GOP/s per core; ymm %.2f/ns = %.2f/cycle = %.0f GOP/s per core\n",
    ghz, z, z/ghz, z*128, y, y/ghz, y*64);
  return 0;
}
