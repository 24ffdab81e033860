
local refused, comparable = fence_of()
if refused then return refused end
local cur = redis.call('HGET', KEYS[1], domain)
if not cur then
  redis.call('HDEL', KEYS[2], domain)
  return {2}
end
if comparable then
  local ok, doc = pcall(cjson.decode, cur)
  local v = ok and type(doc) == 'table' and tonumber(doc.version) or nil
  if v and v > tonumber(ARGV[5]) then return {3} end
end
redis.call('HDEL', KEYS[1], domain)
redis.call('HDEL', KEYS[2], domain)
return {1}
