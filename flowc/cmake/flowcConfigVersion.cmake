# The version of flowc's CMake package: flowc's own (flowc/version.py; a test keeps the two
# equal). find_package(flowc X.Y) accepts this flowc when X.Y <= its version, with the same
# major version, and the same minor version too (when X.Y names one) while the major version
# is 0: before 1.0 a minor version may change the interface. A range (X.Y...Z) is honoured.
set(PACKAGE_VERSION "0.1.0")

set(PACKAGE_VERSION_COMPATIBLE FALSE)
set(PACKAGE_VERSION_EXACT FALSE)
if(NOT DEFINED PACKAGE_FIND_VERSION OR PACKAGE_FIND_VERSION STREQUAL "")
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  return()
endif()

string(REGEX MATCH "^([0-9]+)\\.?([0-9]*)" _flowc_v "${PACKAGE_VERSION}")
set(_flowc_major "${CMAKE_MATCH_1}")
set(_flowc_minor "${CMAKE_MATCH_2}")

if(PACKAGE_FIND_VERSION_RANGE)
  # A range: the lower end as an ordinary request, the upper end as asked (included or not).
  set(_flowc_min "${PACKAGE_FIND_VERSION_MIN}")
  if(PACKAGE_FIND_VERSION_RANGE_MAX STREQUAL "INCLUDE")
    if(PACKAGE_VERSION VERSION_GREATER PACKAGE_FIND_VERSION_MAX)
      return()
    endif()
  elseif(PACKAGE_VERSION VERSION_GREATER_EQUAL PACKAGE_FIND_VERSION_MAX)
    return()
  endif()
  if(PACKAGE_VERSION VERSION_LESS _flowc_min)
    return()
  endif()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
else()
  if(PACKAGE_VERSION VERSION_LESS PACKAGE_FIND_VERSION)
    return()
  endif()
  if(NOT PACKAGE_FIND_VERSION_MAJOR EQUAL _flowc_major)
    return()
  endif()
  if(_flowc_major EQUAL 0 AND PACKAGE_FIND_VERSION_COUNT GREATER 1
     AND NOT PACKAGE_FIND_VERSION_MINOR EQUAL _flowc_minor)
    return()
  endif()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_VERSION VERSION_EQUAL PACKAGE_FIND_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
