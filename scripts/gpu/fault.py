# A sticky error in the calling process's CUDA context, without CuPy: a PTX kernel that stores to
# address 0x10, loaded and launched through libcuda (ctypes) in the primary context of device 0
# (the one PyTorch uses). Returns the CUresult name of the synchronize: CUDA_ERROR_ILLEGAL_ADDRESS
# when the fault happened (the context is then unusable: every later call fails the same way).
import ctypes

PTX = b"""
.version 6.0
.target sm_50
.address_size 64
.visible .entry bad(.param .u64 p)
{
    .reg .u64 %rd<2>;
    .reg .u32 %r<2>;
    ld.param.u64 %rd1, [p];
    mov.u32 %r1, 1;
    st.global.u32 [%rd1], %r1;
    ret;
}
"""


def illegal_address():
    cuda = ctypes.CDLL("libcuda.so.1")

    def name(r):
        s = ctypes.c_char_p()
        cuda.cuGetErrorName(r, ctypes.byref(s))
        return s.value.decode() if s.value else "CUresult %d" % r

    def ok(r, what):
        if r != 0:
            raise RuntimeError("%s: %s" % (what, name(r)))

    ok(cuda.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    ok(cuda.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    ok(cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    ok(cuda.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
    ok(cuda.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(PTX)), "cuModuleLoadData")
    ok(cuda.cuModuleGetFunction(ctypes.byref(fn), mod, b"bad"), "cuModuleGetFunction")
    p = ctypes.c_uint64(0x10)
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(p), ctypes.c_void_p))
    ok(cuda.cuLaunchKernel(fn, 1, 1, 1, 32, 1, 1, 0, None, params, None), "cuLaunchKernel")
    return name(cuda.cuCtxSynchronize())
