// A small msgpack encoder and decoder with numpy arrays tagged the way openpi's msgpack_numpy does
// (what the robot WebSocket speaks): an array travels as the map
//   {b"__ndarray__": true, b"data": <bin: raw bytes>, b"dtype": "<f4", b"shape": [H, D]}
// whose keys are msgpack *bin* values, and a numpy scalar as {b"__npgeneric__": true, b"data", b"dtype"}.
// Plain JS values map to msgpack the usual way: null, booleans, numbers (integers as the smallest
// int format, others as float64), strings (UTF-8), Uint8Array (bin), arrays and plain objects
// (maps with string keys). Extension types are not used by openpi and are refused.

const encoder = new TextEncoder();
const decoder = new TextDecoder();

// numpy dtype strings (dtype.str) this module reads and writes, and their typed arrays
const DTYPES = {
  "|u1": Uint8Array, "|i1": Int8Array, "|b1": Uint8Array,
  "<u2": Uint16Array, "<i2": Int16Array, "<u4": Uint32Array, "<i4": Int32Array,
  "<f4": Float32Array, "<f8": Float64Array, "<i8": BigInt64Array, "<u8": BigUint64Array,
};

/** A numpy array: ``data`` a typed array in row-major order, ``dtype`` its numpy dtype string. */
export class NdArray {
  constructor(data, shape, dtype) {
    const size = shape.reduce((a, b) => a * b, 1);
    if (data.length !== size) throw new Error(`an array of shape [${shape}] needs ${size} values, got ${data.length}`);
    if (!(data instanceof DTYPES[dtype])) throw new Error(`data for dtype ${dtype} must be a ${DTYPES[dtype]?.name}`);
    this.data = data;
    this.shape = shape;
    this.dtype = dtype;
  }

  static uint8(data, shape) {
    return new NdArray(data, shape, "|u1");
  }

  static float32(data, shape) {
    return new NdArray(data instanceof Float32Array ? data : Float32Array.from(data), shape, "<f4");
  }

  /** Row ``i`` of a 2-D array, as a plain array of numbers. */
  row(i) {
    const width = this.shape[1];
    return Array.from(this.data.subarray(i * width, (i + 1) * width), Number);
  }
}

class Writer {
  constructor() {
    this.buf = new Uint8Array(1024);
    this.view = new DataView(this.buf.buffer);
    this.pos = 0;
  }

  reserve(n) {
    if (this.pos + n <= this.buf.length) return;
    let size = this.buf.length * 2;
    while (size < this.pos + n) size *= 2;
    const grown = new Uint8Array(size);
    grown.set(this.buf.subarray(0, this.pos));
    this.buf = grown;
    this.view = new DataView(grown.buffer);
  }

  byte(b) {
    this.reserve(1);
    this.buf[this.pos++] = b;
  }

  // a type byte, then ``value`` as an unsigned integer of ``size`` bytes (big-endian)
  head(type, size, value) {
    this.reserve(1 + size);
    this.buf[this.pos++] = type;
    if (size === 1) this.view.setUint8(this.pos, value);
    else if (size === 2) this.view.setUint16(this.pos, value);
    else if (size === 4) this.view.setUint32(this.pos, value);
    this.pos += size;
  }

  bytes(b) {
    this.reserve(b.length);
    this.buf.set(b, this.pos);
    this.pos += b.length;
  }
}

function writeLength(w, n, fix, fixMax, t8, t16, t32) {
  if (n <= fixMax && fix !== null) w.byte(fix | n);
  else if (n < 0x100 && t8 !== null) w.head(t8, 1, n);
  else if (n < 0x10000) w.head(t16, 2, n);
  else w.head(t32, 4, n);
}

function writeInt(w, n) {
  if (n >= 0 && n < 0x80) return w.byte(n);
  if (n < 0 && n >= -32) return w.byte(n & 0xff);
  if (n >= 0) {
    if (n < 0x100) return w.head(0xcc, 1, n);
    if (n < 0x10000) return w.head(0xcd, 2, n);
    if (n < 0x100000000) return w.head(0xce, 4, n);
    w.byte(0xcf);
    w.reserve(8);
    w.view.setBigUint64(w.pos, BigInt(n));
  } else {
    w.reserve(9);
    if (n >= -0x80) {
      w.buf[w.pos++] = 0xd0;
      w.view.setInt8(w.pos, n);
      w.pos += 1;
      return;
    }
    if (n >= -0x8000) {
      w.buf[w.pos++] = 0xd1;
      w.view.setInt16(w.pos, n);
      w.pos += 2;
      return;
    }
    if (n >= -0x80000000) {
      w.buf[w.pos++] = 0xd2;
      w.view.setInt32(w.pos, n);
      w.pos += 4;
      return;
    }
    w.buf[w.pos++] = 0xd3;
    w.view.setBigInt64(w.pos, BigInt(n));
  }
  w.pos += 8;
}

function writeString(w, s) {
  const b = encoder.encode(s);
  writeLength(w, b.length, 0xa0, 31, 0xd9, 0xda, 0xdb);
  w.bytes(b);
}

function writeBin(w, b) {
  writeLength(w, b.length, null, -1, 0xc4, 0xc5, 0xc6);
  w.bytes(b);
}

function write(w, value) {
  if (value === null || value === undefined) return w.byte(0xc0);
  if (value === false) return w.byte(0xc2);
  if (value === true) return w.byte(0xc3);
  if (typeof value === "number") {
    if (Number.isSafeInteger(value)) return writeInt(w, value);
    w.byte(0xcb);
    w.reserve(8);
    w.view.setFloat64(w.pos, value);
    w.pos += 8;
    return;
  }
  if (typeof value === "string") return writeString(w, value);
  if (value instanceof Uint8Array) return writeBin(w, value);
  if (value instanceof NdArray) {
    // the tag's keys are bin, as numpy-side packers write b"..." keys
    const data = new Uint8Array(value.data.buffer, value.data.byteOffset, value.data.byteLength);
    w.byte(0x84);
    writeBin(w, encoder.encode("__ndarray__"));
    w.byte(0xc3);
    writeBin(w, encoder.encode("data"));
    writeBin(w, data);
    writeBin(w, encoder.encode("dtype"));
    writeString(w, value.dtype);
    writeBin(w, encoder.encode("shape"));
    write(w, value.shape);
    return;
  }
  if (Array.isArray(value)) {
    writeLength(w, value.length, 0x90, 15, null, 0xdc, 0xdd);
    for (const item of value) write(w, item);
    return;
  }
  if (typeof value === "object") {
    const entries = Object.entries(value).filter(([, v]) => v !== undefined);
    writeLength(w, entries.length, 0x80, 15, null, 0xde, 0xdf);
    for (const [k, v] of entries) {
      writeString(w, k);
      write(w, v);
    }
    return;
  }
  throw new TypeError(`cannot encode a ${typeof value} in msgpack`);
}

/** The msgpack bytes of ``value`` (see the module comment for the types). */
export function encode(value) {
  const w = new Writer();
  write(w, value);
  return w.buf.slice(0, w.pos);
}

class Reader {
  constructor(bytes) {
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.pos = 0;
  }

  need(n) {
    if (this.pos + n > this.bytes.length) throw new Error("msgpack: the message ends early");
  }

  take(n) {
    this.need(n);
    const out = this.bytes.subarray(this.pos, this.pos + n);
    this.pos += n;
    return out;
  }

  num(getter, size) {
    this.need(size);
    const v = this.view[getter](this.pos);
    this.pos += size;
    return v;
  }
}

// 64-bit integers: a Number when exact, else a BigInt
const bigToNumber = (b) => (b >= BigInt(Number.MIN_SAFE_INTEGER) && b <= BigInt(Number.MAX_SAFE_INTEGER)
  ? Number(b) : b);

function readMap(r, n) {
  const out = {};
  for (let i = 0; i < n; i++) {
    let key = read(r);
    if (key instanceof Uint8Array) key = decoder.decode(key); // numpy tags use bin keys
    out[key] = read(r);
  }
  return untag(out);
}

// a tagged numpy array or scalar -> NdArray / number; any other map as it is
function untag(map) {
  if (map.__ndarray__ === true) {
    const Typed = DTYPES[map.dtype];
    if (!Typed) throw new Error(`msgpack: numpy dtype ${map.dtype} is not supported by this page`);
    const raw = map.data; // a bin value owns its buffer from offset 0 (read() copies it): aligned
    if (!(raw instanceof Uint8Array) || raw.byteLength % Typed.BYTES_PER_ELEMENT) {
      throw new Error(`msgpack: the data of a ${map.dtype} array is not a whole number of values`);
    }
    return new NdArray(new Typed(raw.buffer, 0, raw.byteLength / Typed.BYTES_PER_ELEMENT), map.shape, map.dtype);
  }
  if (map.__npgeneric__ === true) return map.data;
  return map;
}

function read(r) {
  const t = r.take(1)[0];
  if (t < 0x80) return t;
  if (t < 0x90) return readMap(r, t & 0x0f);
  if (t < 0xa0) return Array.from({ length: t & 0x0f }, () => read(r));
  if (t < 0xc0) return decoder.decode(r.take(t & 0x1f));
  if (t >= 0xe0) return t - 0x100;
  switch (t) {
    case 0xc0: return null;
    case 0xc2: return false;
    case 0xc3: return true;
    case 0xc4: return r.take(r.num("getUint8", 1)).slice();
    case 0xc5: return r.take(r.num("getUint16", 2)).slice();
    case 0xc6: return r.take(r.num("getUint32", 4)).slice();
    case 0xca: return r.num("getFloat32", 4);
    case 0xcb: return r.num("getFloat64", 8);
    case 0xcc: return r.num("getUint8", 1);
    case 0xcd: return r.num("getUint16", 2);
    case 0xce: return r.num("getUint32", 4);
    case 0xcf: return bigToNumber(r.num("getBigUint64", 8));
    case 0xd0: return r.num("getInt8", 1);
    case 0xd1: return r.num("getInt16", 2);
    case 0xd2: return r.num("getInt32", 4);
    case 0xd3: return bigToNumber(r.num("getBigInt64", 8));
    case 0xd9: return decoder.decode(r.take(r.num("getUint8", 1)));
    case 0xda: return decoder.decode(r.take(r.num("getUint16", 2)));
    case 0xdb: return decoder.decode(r.take(r.num("getUint32", 4)));
    case 0xdc: return Array.from({ length: r.num("getUint16", 2) }, () => read(r));
    case 0xdd: return Array.from({ length: r.num("getUint32", 4) }, () => read(r));
    case 0xde: return readMap(r, r.num("getUint16", 2));
    case 0xdf: return readMap(r, r.num("getUint32", 4));
    default: throw new Error(`msgpack: type byte 0x${t.toString(16)} (an extension type) is not supported`);
  }
}

/** The value in msgpack ``bytes`` (a Uint8Array or ArrayBuffer); tagged numpy arrays become NdArray. */
export function decode(bytes) {
  const r = new Reader(bytes instanceof Uint8Array ? bytes : new Uint8Array(bytes));
  const value = read(r);
  if (r.pos !== r.bytes.length) throw new Error(`msgpack: ${r.bytes.length - r.pos} bytes after the message`);
  return value;
}
