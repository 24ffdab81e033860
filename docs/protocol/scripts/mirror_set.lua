
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local ok, doc = pcall(cjson.decode, cur)
  local v = ok and type(doc) == 'table' and tonumber(doc.version) or nil
  if v and v >= tonumber(ARGV[2]) and v <= tonumber(ARGV[4]) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
