// What the C ABI's files share (capi.cpp, capi_step.cpp).
#pragma once

#define FT_API extern "C" __attribute__((visibility("default")))
