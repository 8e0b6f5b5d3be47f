/* Queue a recorded step's kernels from a thread of its own, without Python's GIL (perfx_opencl/native_replay.py).
 *
 * A replayed step is a few hundred clEnqueueNDRangeKernel calls. From Python each one holds the GIL, so the
 * server's HTTP thread and the step's queueing slow each other down (NVIDIA's driver: ~6 us per launch alone,
 * ~15 us with another busy Python thread). Here the loop runs on a POSIX thread: the caller goes on with its
 * own work (the previous step's text) while the device is fed, and joins before its next use of the queue.
 *
 * The OpenCL entry points come from the caller (the ICD loader pyopencl uses), so this file needs no OpenCL
 * headers or library at build time. */
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

typedef int32_t (*enqueue_kernel_fn)(void *queue, void *kernel, uint32_t work_dim, const size_t *offset,
                                     const size_t *global_size, const size_t *local_size, uint32_t n_events,
                                     const void *wait_list, void *event);
typedef int32_t (*flush_fn)(void *queue);

/* Mirrored by _Job in native_replay.py: keep the two in step. */
typedef struct {
    enqueue_kernel_fn enqueue;
    flush_fn flush;
    void *queue;
    int32_t count;              /* launches */
    void *const *kernels;       /* cl_kernel per launch */
    const uint32_t *dims;       /* work dimensions per launch */
    const size_t *global_sizes; /* 3 per launch */
    const size_t *local_sizes;  /* 3 per launch */
    const uint8_t *has_local;   /* 0: the driver picks the work-group size */
    const uint8_t *flush_after; /* 1: flush once this launch is queued (the last one always is) */
    int32_t failed_at;          /* out: -1, or the launch whose enqueue failed (count: the final flush) */
    int32_t status;             /* out: 0, or that call's OpenCL error code */
    pthread_t thread;
} perfx_replay_job;

static void *replay(void *arg) {
    perfx_replay_job *job = (perfx_replay_job *)arg;
    job->failed_at = -1;
    job->status = 0;
    for (int32_t i = 0; i < job->count; i++) {
        const size_t *local = job->has_local[i] ? job->local_sizes + 3 * i : NULL;
        int32_t rc = job->enqueue(job->queue, job->kernels[i], job->dims[i], NULL, job->global_sizes + 3 * i, local,
                                  0, NULL, NULL);
        if (rc == 0 && job->flush_after[i]) rc = job->flush(job->queue);
        if (rc != 0) {
            job->failed_at = i;
            job->status = rc;
            return NULL;
        }
    }
    int32_t rc = job->flush(job->queue); /* the caller may do other work before it reads anything back */
    if (rc != 0) {
        job->failed_at = job->count;
        job->status = rc;
    }
    return NULL;
}

/* Start queueing on a new thread; 0 when it started (then perfx_replay_join must follow), else pthread's error. */
int perfx_replay_start(perfx_replay_job *job) { return pthread_create(&job->thread, NULL, replay, job); }

/* Wait for the thread; returns the job's status (0 when every launch was queued). */
int perfx_replay_join(perfx_replay_job *job) {
    pthread_join(job->thread, NULL);
    return job->status;
}
