
local clock = redis.call('TIME')
local now = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local keep = tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  local v = redis.call('HGET', KEYS[1], ARGV[i])
  if v then
    local ok, r = pcall(cjson.decode, v)
    local seen = nil
    if ok and type(r) == 'table' and type(r.seen_ms) == 'number' then
      local off = 0
      if type(r.offset_ms) == 'number' then off = r.offset_ms end
      seen = r.seen_ms - off
    end
    if (not seen) or now - seen > keep then
      redis.call('HDEL', KEYS[1], ARGV[i])
      n = n + 1
    end
  end
end
return n
