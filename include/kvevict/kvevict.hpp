// kvevict/kvevict.hpp: every host-side public header. CUDA launchers are in <kvevict/cuda/*.cuh>.
#pragma once

#include <kvevict/backend.hpp>
#include <kvevict/budget.hpp>
#include <kvevict/compact.hpp>
#include <kvevict/config.hpp>
#include <kvevict/driver.hpp>
#include <kvevict/gqa.hpp>
#include <kvevict/lookahead.hpp>
#include <kvevict/metrics.hpp>
#include <kvevict/numeric.hpp>
#include <kvevict/pool.hpp>
#include <kvevict/postprocess.hpp>
#include <kvevict/protect.hpp>
#include <kvevict/prulong.hpp>
#include <kvevict/recipes.hpp>
#include <kvevict/score.hpp>
#include <kvevict/select.hpp>
#include <kvevict/status.hpp>
#include <kvevict/view.hpp>
#include <kvevict/weight.hpp>
#include <kvevict/workspace.hpp>
