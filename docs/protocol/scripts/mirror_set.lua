
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

local refused, comparable, mine, age = fence_of()
if refused then return refused end
local cur = redis.call('HGET', KEYS[1], domain)
if cur then
  local ok, doc = pcall(cjson.decode, cur)
  local v = ok and type(doc) == 'table' and tonumber(doc.version) or nil
  if comparable and v and v >= tonumber(ARGV[5]) and v <= tonumber(ARGV[7]) then
    if not mine or age >= stale / 4 then claim() end
    return {2}
  end
end
redis.call('HSET', KEYS[1], domain, ARGV[6])
claim()
return {1}
