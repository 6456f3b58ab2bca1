/* A libOpenCL.so for the PlaidML OpenCL test: PlaidML 0.7 lists only GPU-type OpenCL devices,
   and this machine's OpenCL device (PoCL) is a CPU. Every call goes to the real ICD loader
   (linked as libOpenCL.so.1); clGetDeviceInfo(CL_DEVICE_TYPE) reports CPU devices as GPUs.
   Build: gcc -shared -fPIC -o DIR/libOpenCL.so opencl_cpu_as_gpu.c -ldl -Wl,--no-as-needed -l:libOpenCL.so.1 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stddef.h>
#include <stdint.h>

typedef int32_t cl_int;
typedef uint32_t cl_uint;
typedef uint64_t cl_bitfield;
typedef void *cl_device_id;

enum { DEVICE_TYPE_QUERY = 0x1000, TYPE_CPU = 1 << 1, TYPE_GPU = 1 << 2 };

typedef cl_int (*get_device_info_fn)(cl_device_id, cl_uint, size_t, void *, size_t *);

cl_int clGetDeviceInfo(cl_device_id device, cl_uint param, size_t size, void *value, size_t *size_ret) {
    static get_device_info_fn forward;
    if (!forward) {
        void *loader = dlopen("libOpenCL.so.1", RTLD_NOW | RTLD_GLOBAL);
        forward = loader ? (get_device_info_fn)dlsym(loader, "clGetDeviceInfo") : NULL;
        if (!forward) return -1; /* CL_DEVICE_NOT_FOUND */
    }
    cl_int status = forward(device, param, size, value, size_ret);
    if (status == 0 && param == DEVICE_TYPE_QUERY && value && size >= sizeof(cl_bitfield)) {
        cl_bitfield *type = (cl_bitfield *)value;
        if (*type & TYPE_CPU) *type = (*type & ~(cl_bitfield)TYPE_CPU) | TYPE_GPU;
    }
    return status;
}
