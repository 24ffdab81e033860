
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
