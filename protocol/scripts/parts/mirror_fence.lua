
local domain = ARGV[1]
local term = tonumber(ARGV[2])
local epoch = ARGV[3]
local stale = tonumber(ARGV[4])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function fence_of()
  local f = redis.call('HGET', KEYS[2], domain)
  if not f then return nil, true, false, 0 end
  local e, t, at = string.match(f, '^(%S+) (%-?%d+) (%-?%d+)$')
  if not e then return nil, true, false, 0 end
  t = tonumber(t)
  local age = now - tonumber(at)
  if e ~= epoch then
    if age < stale then return {4, t, age, e}, false, false, age end
    return nil, false, false, age
  end
  if t > term then
    if age < stale then return {0, t, age}, false, false, age end
    return nil, false, false, age
  end
  return nil, true, t == term, age
end
local function claim()
  redis.call('HSET', KEYS[2], domain, epoch .. ' ' .. term .. ' ' .. now)
end
