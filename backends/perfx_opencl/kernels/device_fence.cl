// Prepended to every kernel file (runtime.py program). DEVICE_FENCE(): a device-wide memory fence for the
// last-work-group-finishes patterns (add_norm_tail.cl, attention.cl's merge). OpenCL 1.2's
// mem_fence only orders one work-item's own accesses (NVIDIA compiles it to a CTA-scope membar), so on NVIDIA the runtime
// builds with -DNV_MEMBAR_GL=1 or 2 (the inline-PTX form its compiler took) for a device-scope fence;
// PoCL's CPU threads are coherent. Other devices do not run these kernels (ops.py uses separate launches).
#ifndef DEVICE_FENCE
#if NV_MEMBAR_GL == 1
#define DEVICE_FENCE() asm volatile("membar.gl;" ::: "memory")
#elif NV_MEMBAR_GL == 2
#define DEVICE_FENCE() asm volatile("membar.gl;")
#else
#define DEVICE_FENCE() mem_fence(CLK_GLOBAL_MEM_FENCE)
#endif
#endif
