// Precompiled header shared by every composer target: the heavy, stable includes.
#pragma once
#include <torch/torch.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
